"""Deployment commands of the ``vidx`` CLI: ``vidx serve-config`` writes the Serve config made from
the settings (``pipeline.serve.config``), alone or into a KubeRay RayService manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.settings import Settings

#: Exit status of a command given bad input (a settings file, a manifest).
USAGE_EXIT = 2


class _FileSettings(Settings):
    """Settings from the values given and the defaults only: no ``VIDX_`` variable counts."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: Any, init_settings: Any, env_settings: Any, dotenv_settings: Any, file_secret_settings: Any
    ) -> tuple[Any, ...]:
        return (init_settings,)


def load_settings(path: Path | None, use_env: bool, base: Settings | None = None) -> Settings:
    """The settings of a config: ``path`` (a YAML mapping shaped like ``Settings``, e.g.
    infra/kuberay/settings.yaml) over the environment, or over the defaults alone when not ``use_env``.

    Raises:
        ValueError: unreadable file, not a mapping, or settings the model rejects (pydantic's
            ValidationError is a ValueError).
    """
    import yaml

    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read the settings file {path}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"the settings file {path} must hold a mapping of settings")
        values = loaded or {}
    if not use_env:
        return _FileSettings(**values)
    if base is not None and not values:
        return base
    return Settings(**values)


def serve_config(
    ctx: typer.Context,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", metavar="FILE", help="Write the config to FILE (default: stdout).")
    ] = None,
    settings_file: Annotated[
        Path | None, typer.Option("--settings", metavar="FILE", help="YAML settings over the environment's.")
    ] = None,
    no_env: Annotated[
        bool, typer.Option("--no-env", help="Ignore VIDX_ variables (how the committed files are made).")
    ] = False,
    gpu: Annotated[bool, typer.Option("--gpu", help="For a cluster with GPUs (the Encoder reserves one).")] = False,
    rayservice: Annotated[
        Path | None,
        typer.Option("--rayservice", metavar="FILE", help="Rewrite the serveConfigV2 of this RayService manifest."),
    ] = None,
) -> None:
    """Print the Ray Serve config (serve deploy / serve run / KubeRay serveConfigV2) made from the
    settings. Credentials are never written: the app reads them from the environment."""
    from pydantic import ValidationError

    from pipeline.serve.config import embed, render, validate_serve_config
    from pipeline.serve.config import serve_config as make_config

    try:
        settings = load_settings(settings_file, use_env=not no_env, base=ctx.obj)
        config = make_config(settings, gpu=gpu)
        validate_serve_config(config)
        if rayservice is not None:
            rayservice.write_text(embed(rayservice.read_text(encoding="utf-8"), config), encoding="utf-8")
            typer.echo(f"serveConfigV2 of {rayservice} updated", err=True)
        text = render(config)
        if out is not None:
            out.write_text(text, encoding="utf-8")
        elif rayservice is None:
            typer.echo(text, nl=False)
    except ValidationError as exc:  # never the input: it may hold credentials
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        typer.echo(f"vidx serve-config: invalid settings: {where}: {first['msg']}", err=True)
        raise typer.Exit(USAGE_EXIT) from None
    except (ValueError, OSError) as exc:
        typer.echo(f"vidx serve-config: {exc}", err=True)
        raise typer.Exit(USAGE_EXIT) from None

"""The ``leases`` table: named leases (index maintenance, the backfill, the scheduled check) that one
worker holds at a time, taken and renewed by one conditional ``merge_insert``. ``pipeline.upkeep.leased_loop``
runs a service's rounds under one."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from storage.db import PRIMARY_KEY, IndexDatabase, sql_quote, write_errors_are_transient

LEASES = "leases"

#: One row per named lease: who holds it and until when (epoch seconds).
LEASES_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False, metadata=PRIMARY_KEY),
        pa.field("holder", pa.string(), nullable=False),
        pa.field("expires_at_s", pa.float64(), nullable=False),
    ]
)


class Leases:
    def __init__(self, db: IndexDatabase) -> None:
        self._db = db
        self._table: Any = None

    @write_errors_are_transient
    def acquire(self, name: str, holder: str, ttl_s: float, now_s: float) -> bool:
        """Take or renew the lease ``name`` for ``holder`` until ``now_s + ttl_s``; False while another
        holder has it. Of two workers racing for it, one commit wins."""
        if self._table is None:
            self._table = self._db.create(LEASES, LEASES_SCHEMA)
        row = pa.Table.from_pylist(
            [{"name": name, "holder": holder, "expires_at_s": now_s + ttl_s}], schema=LEASES_SCHEMA
        )
        result = (
            self._table.merge_insert("name")
            .when_matched_update_all(where=f"target.holder = {sql_quote(holder)} OR target.expires_at_s < {now_s!r}")
            .when_not_matched_insert_all()
            .execute(row)
        )
        return int(result.num_updated_rows) + int(result.num_inserted_rows) > 0

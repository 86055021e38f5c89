"""Video in, frames out: probing, decoding and sampling with PyAV, and the worker processes that bound it."""

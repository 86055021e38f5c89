"""Benchmarks of one stage each (decode, encode, write, search, bucket events, the text sources' cost),
against its baseline in the same run."""

"""EMA-PG for users of other training frameworks (each needs its own optional extra)."""

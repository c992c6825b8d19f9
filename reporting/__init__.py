"""Reporting over committed metrics: DuckDB views and figures, tables, the HTML dashboard, a
run's summary and `corpusgen plan`'s estimate. Imports nothing of the project but schemas:
callers hand it filesystems, tables and counts."""

"""Rows on disk and what is made of them: the table's schema and files (table.py), the reports (report.py),
env.json (provenance.py), the published nanoVLM table (published.py), the finding check (finding.py) and the
regression gate (compare.py)."""

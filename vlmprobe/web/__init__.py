"""`vlmprobe serve`: the question as a web form, answered by vlmprobe.api in the server (fields.py: the form's
fields and their overrides; jobs.py: one estimate at a time; page.py: the page; app.py: the FastAPI app; serve.py:
the command). Needs the web extra: pip install -e ".[web]"."""

__all__: list[str] = []

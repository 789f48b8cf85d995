"""The FastAPI app of `vlmprobe serve`: the page, an estimate asked, its progress polled, its report.html.

FastAPI (with uvicorn) rather than Gradio: the page is one small template whose every input this project writes
and checks (vlmprobe.web.fields), it fetches nothing from elsewhere, and the extra is two small packages; Gradio
brings its own front end, components and their network calls, for a page this size. Routes (fastapi 0.165,
starlette 1.10, read from their docs and source): GET / the page (a URL's query fills the form; run=1 asks at once),
POST /estimate a JSON object of the form's fields -> {job} or 400 {error: one line} / 409 (one at a time per
client), GET /jobs/{id} its state, progress and, once over, the answer's HTML, GET /report/{id} its report.html.
A client is a browser's cookie (vlmprobe_client), or its address without one.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from vlmprobe.errors import ConfigError, first_line
from vlmprobe.web.fields import command_line, question_of, url_of
from vlmprobe.web.jobs import Busy, Jobs
from vlmprobe.web.page import answer_html, page_html

__all__ = ["COOKIE", "make_app"]

COOKIE = "vlmprobe_client"


def client_of(request: Request) -> str:
    return request.cookies.get(COOKIE) or (request.client.host if request.client else "?")


def make_app(results_dir: Path, run=None) -> FastAPI:
    """The app, its estimates' results dirs under `results_dir`; `run`: a stand-in for vlmprobe.api.run (tests)."""
    app = FastAPI(title="vlmprobe", docs_url=None, redoc_url=None, openapi_url=None)
    jobs = Jobs(results_dir, run)
    app.state.jobs = jobs

    @app.get("/", response_class=HTMLResponse)
    def page(request: Request) -> HTMLResponse:
        values = {k: v[:200] for k, v in request.query_params.items() if k != "run"}
        response = HTMLResponse(page_html(values))
        if COOKIE not in request.cookies:
            response.set_cookie(COOKIE, secrets.token_hex(12), httponly=True, samesite="strict")
        return response

    @app.post("/estimate")
    async def estimate(request: Request) -> JSONResponse:
        try:
            form = await request.json()
        except ValueError:
            return JSONResponse({"error": "vlmprobe: the request is not allowed: send the form as a JSON object"},
                                status_code=400)
        try:
            question = question_of(form)
        except ConfigError as exc:
            return JSONResponse({"error": f"vlmprobe: {exc}"}, status_code=400)
        try:
            job = jobs.submit(client_of(request), question)
        except Busy as exc:
            return JSONResponse({"error": f"vlmprobe: {exc}"}, status_code=409)
        return JSONResponse({"job": job.id, "url": url_of(question), "command": command_line(question)})

    @app.get("/jobs/{job_id}")
    def status(job_id: str) -> JSONResponse:
        job = jobs.get(job_id)
        if job is None:
            return JSONResponse({"error": f"vlmprobe: job {job_id[:40]!r} is not known here"}, status_code=404)
        elapsed = ((job.finished or time.time()) - job.started) if job.started else 0.0
        body = {"state": job.state, "ahead": jobs.ahead(job), "elapsed_s": round(elapsed, 1),
                "progress": job.progress[-50:], "error": job.error, "html": ""}
        if job.over:
            try:
                body["html"] = answer_html(job, f"/report/{job.id}")
            except Exception as exc:  # the rows are on disk whatever the page makes of them: say so in one line
                body["error"] = body["error"] or (f"vlmprobe: the answer could not be shown ({type(exc).__name__}: "
                                                  f"{first_line(exc)}); the results dir has it")
        return JSONResponse(body)

    @app.get("/report/{job_id}", response_class=HTMLResponse)
    def report(job_id: str) -> HTMLResponse:
        job = jobs.get(job_id)
        path = job.result.out_dir / "report.html" if job and job.result else None
        if path is None or not path.is_file():
            return HTMLResponse("<p>no report.html for this job</p>", status_code=404)
        return HTMLResponse(path.read_text())

    return app

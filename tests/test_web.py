"""vlmprobe serve: only the form's known fields reach the config, each checked against an allow-list or a type and
refused in the command line's one line; the served answer is vlmprobe.api's (the same verdict as a run of the API,
the same command line); one estimate at a time per client; `vlmprobe serve` refuses a bad argument in one line
(exit 2) and warns about a host other than this machine; and in a real browser (Chromium, tests/browser.py) the page
asks a tiny model's question and shows the verdict and the picture."""

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pandas as pd
import pytest

from browser import open_browser, served
from conftest import REPO
from vlmprobe.api import Result, run
from vlmprobe.config.overrides import with_hub_ids
from vlmprobe.errors import ConfigError
from vlmprobe.results.answer import verdict
from vlmprobe.web.fields import command_line, question_of, url_of
from vlmprobe.web.serve import parse

TINY = {"model": "nanovlm_tiny", "device": "rtx4090", "data.batch_size": "2", "data.lm_max_length": "64"}


def test_the_form_becomes_the_command_lines_overrides_and_its_url():
    question = question_of({**TINY, "ask": "advise", "train.lora_r": " 16 ", "train.autocast_dtype": "null",
                            "train.grad_ckpt.lm": "true", "data.image_size": ""})
    assert question.overrides == ("+advise=fit", "model=nanovlm_tiny", "device=rtx4090", "data.batch_size=2",
                                  "data.lm_max_length=64", "train.autocast_dtype=null", "train.grad_ckpt.lm=true",
                                  "train.lora_r=16")
    assert command_line(question) == ("vlmprobe +advise=fit model=nanovlm_tiny device=rtx4090 data.batch_size=2 "
                                      "data.lm_max_length=64 train.autocast_dtype=null train.grad_ckpt.lm=true "
                                      "train.lora_r=16")
    assert url_of(question) == ("/?ask=advise&model=nanovlm_tiny&device=rtx4090&data.batch_size=2&"
                                "data.lm_max_length=64&train.autocast_dtype=null&train.grad_ckpt.lm=true&"
                                "train.lora_r=16&run=1")


def test_a_recipe_is_a_group_choice_of_the_form():
    assert question_of({**TINY, "recipe": "llamafactory"}).overrides[2] == "recipe=llamafactory"
    with pytest.raises(ConfigError, match=r"^recipe='my.yaml' is not allowed: use one of hf_trainer, internvl, "):
        question_of({**TINY, "recipe": "my.yaml"})  # a file path from the web: no


def test_a_hub_id_is_taken_as_the_command_line_takes_it():
    question = question_of({"model": "Qwen/Qwen2-VL-2B-Instruct"})
    assert question.overrides == ("model=Qwen/Qwen2-VL-2B-Instruct",)
    assert with_hub_ids(list(question.overrides)) == ["model=qwen2_vl_2b"]  # what vlmprobe.api.run does with it


@pytest.mark.parametrize("form, line", [
    ({"model": "nanovlm_tiny", "_target_": "os.system"}, r"^_target_ is not allowed: the form takes ask, model, "),
    ({"model": "nanovlm_tiny", "hydra.run.dir": "/"}, r"^hydra.run.dir is not allowed: the form takes "),
    ({"model": "${oc.env:HOME}"}, r"^model='\$\{oc.env:HOME\}' is not allowed: use one of the shipped models \("),
    ({"model": "nanovlm_tiny", "data.batch_size": "1,2"},
     r"^data.batch_size='1,2' is not allowed: give a whole number from 1 to 65,536$"),
    ({"model": "nanovlm_tiny", "train.lora_r": "-1"}, r"^train.lora_r='-1' is not allowed: give a whole number from 0"),
    ({"model": "nanovlm_tiny", "device": "rtx9999"}, r"^device='rtx9999' is not allowed: use one of a100_40gb, "),
    ({"model": "nanovlm_tiny", "train.freeze_vision": "${x}"}, r"^train.freeze_vision='\$\{x\}' is not allowed: use "
                                                               r"one of true, false$"),
    ({"model": "nanovlm_tiny", "data.lm_max_length": ["1"]}, r"^data.lm_max_length=\['1'\] is not allowed: give it "),
    ({"model": "nanovlm_tiny", "ask": "sweep"}, r"^ask='sweep' is not allowed: use one of check, advise$"),
    ({"device": "rtx4090"}, r"^model is not allowed empty"),
])
def test_only_known_fields_with_allowed_values_reach_the_config(form, line):
    with pytest.raises(ConfigError, match=line):
        question_of(form)


def ask(url: str, path: str, body: dict | None = None, cookie: str = "a") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                     "Cookie": f"vlmprobe_client={cookie}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def finished(url: str, job: str) -> dict:
    deadline = time.time() + 120
    while time.time() < deadline:
        _, state = ask(url, f"/jobs/{job}")
        if state["state"] in ("done", "failed"):
            return state
        time.sleep(0.2)
    raise AssertionError("the job did not finish")


def test_the_served_answer_is_the_apis_answer_and_a_refusal_is_the_commands_line(tmp_path):
    direct = run(results_dir=str(tmp_path / "direct"), launcher="local",
                 **{k: int(v) if v.isdigit() else v for k, v in TINY.items()})
    with served(tmp_path / "served") as (url, _):
        status, body = ask(url, "/estimate", TINY)
        assert status == 200 and body["command"] == "vlmprobe " + " ".join(f"{k}={v}" for k, v in TINY.items())
        state = finished(url, body["job"])
        assert state["state"] == "done" and state["error"] == ""
        (row,) = direct.table.to_dict("records")
        assert verdict(row).startswith("default: fits on the NVIDIA GeForce RTX 4090")
        assert f'<li class="verdict fits">{verdict(row)}</li>' in state["html"]
        assert "default: ok, peak 18.6 MiB (estimate)" in "\n".join(state["progress"])
        assert '<svg class="chart breakdown"' in state["html"] and "These figures are estimates" in state["html"]
        with pytest.raises(ConfigError) as refused:  # the command's own check, past the form's
            run(model="nanovlm_tiny", device="t4", results_dir=str(tmp_path / "direct"))
        status, body = ask(url, "/estimate", {"model": "nanovlm_tiny", "device": "t4"})
        assert status == 200
        assert finished(url, body["job"])["error"] == f"vlmprobe: {refused.value}"
        status, body = ask(url, "/estimate", {"model": "nanovlm_tiny", "data.batch_size": "0"})
        assert (status, body["error"]) == (400, "vlmprobe: data.batch_size='0' is not allowed: give a whole number "
                                                "from 1 to 65,536")


def test_one_estimate_at_a_time_per_client(tmp_path):
    release = threading.Event()

    def held(*args, **settings):  # stands in for vlmprobe.api.run until released
        release.wait(30)
        return Result(pd.DataFrame(), tmp_path, 0)

    with served(tmp_path, held) as (url, app):
        assert ask(url, "/estimate", TINY, cookie="a")[0] == 200
        status, body = ask(url, "/estimate", TINY, cookie="a")
        assert status == 409 and body["error"].startswith("vlmprobe: one estimate at a time: yours (number 1) is ")
        status, other = ask(url, "/estimate", TINY, cookie="b")  # another client queues behind it
        assert status == 200 and ask(url, f"/jobs/{other['job']}")[1]["ahead"] == 1
        release.set()
        finished(url, other["job"])
        assert ask(url, "/estimate", TINY, cookie="a")[0] == 200


@pytest.mark.parametrize("args, line", [
    (["--port", "x"], "vlmprobe: serve: --port='x' is not allowed: give a port number from 0 to 65535"),
    (["--port=70000"], "vlmprobe: serve: --port='70000' is not allowed: give a port number from 0 to 65535"),
    (["--bind", "0.0.0.0"], "vlmprobe: serve: --bind is not allowed: vlmprobe serve [--host HOST] [--port N] "
                            "[--results-dir DIR]"),
])
def test_serve_refuses_a_bad_argument_in_one_line_before_loading_anything(args, line):
    proc = subprocess.run([sys.executable, "-m", "vlmprobe", "serve", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line, "")


def test_serve_binds_to_this_machine_unless_told_otherwise():
    assert parse([]) == {"host": "127.0.0.1", "port": 8000, "results_dir": None}
    assert parse(["--host", "0.0.0.0", "--port", "9000"])["host"] == "0.0.0.0"


@pytest.mark.slow  # ~15 s here: Chromium, and a tiny model's estimate
@pytest.mark.browser
def test_the_page_answers_a_tiny_models_question_in_chromium(tmp_path):
    with served(tmp_path) as (url, _), open_browser() as browser:
        page = browser.page
        page.goto(url + "/")
        page.fill("input[name=model]", "qwen2_vl_tiny")
        page.select_option("select[name=device]", "rtx4090")
        page.fill("input[name='data.batch_size']", "2")
        page.fill("input[name='data.lm_max_length']", "128")
        page.click("#go")
        page.wait_for_selector("li.verdict", timeout=120_000)
        assert page.locator("li.verdict").inner_text().startswith("default: fits on the NVIDIA GeForce RTX 4090")
        assert page.locator("#answer svg.chart.breakdown g.bar").count() == 1
        assert page.locator("#answer pre.command").inner_text() == (
            "vlmprobe model=qwen2_vl_tiny device=rtx4090 data.batch_size=2 data.lm_max_length=128")
        assert "run=1" in page.url and "model=qwen2_vl_tiny" in page.url  # the URL asks it again
        page.fill("input[name='data.batch_size']", "zero")
        page.click("#go")
        page.wait_for_function("document.getElementById('error').textContent.length > 0")
        assert page.locator("#error").inner_text() == ("vlmprobe: data.batch_size='zero' is not allowed: give a whole "
                                                       "number from 1 to 65,536")
        refusal = "Failed to load resource: the server responded with a status of 400 (Bad Request)"
        assert browser.errors == [refusal]  # the refused value's answer, and nothing else
        assert all(r.startswith(url) for r in browser.requests)  # nothing from elsewhere

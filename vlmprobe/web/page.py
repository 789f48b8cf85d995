"""The page `vlmprobe serve` shows: the form (a Jinja2 template, its style and script inlined: nothing is fetched
from elsewhere), and the answer as an HTML fragment the page's script puts in place.

The answer is what the terminal prints (the table and a verdict per point, or the advisor's ranking), the
verdicts set apart, the advisor's table (advise.csv, GiB = 2^30 B), and pictures drawn by
vlmprobe.results.html_report: the breakdown of each point's peak against the card's capacity, and memory over
the step where the results dir has timeline.jsonl. Every piece of text is escaped (Jinja2's autoescape; html.escape
in the fragment). Known limits: the page's script needs a browser with fetch and the History API (every current one).
"""

from __future__ import annotations

import html
import math

import jinja2

from vlmprobe.results import html_report
from vlmprobe.results.answer import records, verdict
from vlmprobe.sizes import GiB
from vlmprobe.web.fields import FIELDS, QUESTIONS, command_line, url_of
from vlmprobe.web.jobs import Job

__all__ = ["answer_html", "page_html"]

TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlmprobe: will it fit?</title><link rel="icon" href="data:,">
<style>
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222;max-width:1100px}
h1{font-size:1.4em}form{display:grid;grid-template-columns:repeat(3,minmax(220px,1fr));gap:.5em 1.2em}
label{display:flex;flex-direction:column;font-size:.85em;color:#444}
input,select{font-size:1em;padding:2px}fieldset{border:1px solid #ccc;grid-column:1/-1}
.wide{grid-column:1/-1}button{font-size:1.05em;padding:.3em 1.2em}
#error{color:#b00;font-weight:600;white-space:pre-wrap}#progress{color:#555;white-space:pre-wrap;font-size:.85em}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:12px}.verdict{font-weight:600}
.fits{color:#060}.nofit{color:#b00}.estimate{color:#a40;font-weight:600}
table.advice{border-collapse:collapse;font-size:12px}table.advice td,table.advice th{border:1px solid #ccc;padding:2px 6px}
.chart{display:block;margin:.6em 0;border:1px solid #ddd;background:#fff;max-width:100%;height:auto}
.chart text{font-size:11px;fill:#222}.chart .title{font-size:14px;font-weight:600}.grid{stroke:#e5e5e5}
.plot-area{stroke:#999}.hidden{display:none}
</style></head><body>
<h1>vlmprobe: how much GPU memory does this VLM training setup need?</h1>
<p>Runs the real training step of the model's architecture (random weights). Without a GPU on the server the figures are
<span class="estimate">estimates</span> for the card chosen; each row says which. Sizes in GiB = 1024<sup>3</sup> bytes.</p>
<form id="ask">
  <label class="wide">question<select name="ask">
  {% for key, text in questions.items() %}<option value="{{ key }}"{% if values.get('ask', 'check') == key %} selected{% endif %}>{{ text }}</option>{% endfor %}
  </select></label>
  {% for f in fields %}
  <label>{{ f.label }}
  {% if f.kind == 'model' %}
    <input name="{{ f.name }}" list="models" value="{{ values.get(f.name, '') }}" placeholder="nanovlm_222m or ORG/NAME">
  {% elif f.kind == 'int' %}
    <input name="{{ f.name }}" inputmode="numeric" value="{{ values.get(f.name, '') }}" placeholder="default">
  {% else %}
    <select name="{{ f.name }}"><option value="">default</option>
    {% for c in f.choices %}<option value="{{ c }}"{% if values.get(f.name) == c %} selected{% endif %}>{{ c }}</option>{% endfor %}
    </select>
  {% endif %}
  </label>
  {% endfor %}
  <datalist id="models">{% for m in models %}<option value="{{ m }}">{% endfor %}</datalist>
  <div class="wide"><button id="go" type="submit">Estimate</button></div>
</form>
<div id="error" role="alert"></div>
<div id="progress"></div>
<div id="answer"></div>
<script>
(function(){
  var form=document.getElementById('ask'),go=document.getElementById('go');
  var error=document.getElementById('error'),progress=document.getElementById('progress'),answer=document.getElementById('answer');
  function values(){
    var out={};
    Array.prototype.forEach.call(form.elements,function(e){if(e.name&&e.value.trim()!=='')out[e.name]=e.value.trim();});
    return out;
  }
  function poll(id){
    fetch('/jobs/'+id).then(function(r){return r.json();}).then(function(j){
      var head=j.state==='queued'?('queued: '+j.ahead+' ahead'):(j.state+', '+j.elapsed_s+' s');
      progress.textContent=head+(j.progress.length?'\\n'+j.progress.slice(-12).join('\\n'):'');
      if(j.state==='done'||j.state==='failed'){
        go.disabled=false;
        if(j.error)error.textContent=j.error;
        answer.innerHTML=j.html||'';
        return;
      }
      setTimeout(function(){poll(id);},400);
    });
  }
  form.addEventListener('submit',function(ev){
    ev.preventDefault();
    error.textContent='';answer.innerHTML='';progress.textContent='sending';
    go.disabled=true;
    fetch('/estimate',{method:'POST',headers:{'Content-Type':'application/json'},body:JSON.stringify(values())})
      .then(function(r){return r.json().then(function(j){return [r.status,j];});})
      .then(function(res){
        var j=res[1];
        if(res[0]!==200){error.textContent=j.error;progress.textContent='';go.disabled=false;return;}
        history.replaceState(null,'',j.url);
        poll(j.job);
      });
  });
  if(new URLSearchParams(location.search).get('run')==='1')form.requestSubmit();
})();
</script>
</body></html>
"""
ENVIRONMENT = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
PAGE = ENVIRONMENT.from_string(TEMPLATE)


def page_html(values: dict) -> str:
    """The form, filled with `values` (a URL's query: text only, echoed escaped)."""
    values = {str(k): str(v) for k, v in values.items()}
    models = next(f.choices for f in FIELDS if f.name == "model")
    return PAGE.render(fields=FIELDS, values=values, questions=QUESTIONS, models=models)


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def gib(value) -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(value) else f"{value / GiB:.2f}"


def advice_html(advice) -> str:
    """advise.csv as a table: the knobs ranked by what they save (GiB)."""
    heads = ["knob", "saves GiB", "card GiB", "fits", "training", "cost"]
    lines = ['<table class="advice"><thead><tr>' + "".join(f"<th>{h}</th>" for h in heads) + "</tr></thead><tbody>"]
    for row in records(advice):
        cells = [row.get("knob"), gib(row.get("saves_bytes")), gib(row.get("card_bytes")),
                 "yes" if row.get("fits") in (True, "True", "true") else "no", row.get("training"), row.get("cost")]
        lines.append("<tr>" + "".join(f"<td>{esc('-' if c is None else c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines + ["</tbody></table>"])


def answer_html(job: Job, report_url: str) -> str:
    """The finished job's answer: links that ask it again, the verdicts, the terminal's text, the advisor's table,
    the pictures."""
    question = job.question
    parts = [f'<p>Ask it again: <a class="again" href="{esc(url_of(question))}">this page with these values</a>, '
             f'or in a terminal:</p><pre class="command">{esc(command_line(question))}</pre>']
    if job.result is None:
        return "\n".join(parts)
    table, out_dir = job.result.table, job.result.out_dir
    rows = records(table)
    backends = sorted({str(r.get("backend")) for r in rows if r.get("backend")})
    if "estimate" in backends:
        parts.append('<p class="estimate">These figures are estimates (backend estimate): no GPU was used.</p>')
    if not question.advise:
        parts.append("<ul>" + "".join(
            f'<li class="verdict {"fits" if ": fits" in (v := verdict(r)) else "nofit" if "does not fit" in v else ""}">'
            f"{esc(v)}</li>" for r in rows) + "</ul>")
    parts.append(f'<h3>The answer, as the terminal gives it</h3><pre class="answer">{esc(job.answer.rstrip())}</pre>')
    advice = job.result.advice
    if question.advise and advice is not None:
        parts += ["<h3>Knobs ranked by what they save</h3>", advice_html(advice)]
    capacity = html_report.capacity_of(rows)
    parts += ["<h3>What fills the peak</h3>", html_report.breakdown_svg(rows, capacity=capacity)]
    timelines = html_report.load_timelines(out_dir) or {}
    pictures = [svg for point, entry in timelines.items() if (svg := html_report.timeline_svg(str(point), entry))]
    if pictures:
        parts += ["<h3>Memory over the step</h3>", *pictures]
    parts.append(f'<p>Results dir on the server: <code>{esc(out_dir)}</code>; '
                 f'<a class="report" href="{esc(report_url)}" target="_blank">its report.html</a></p>')
    return "\n".join(parts)

"""The rollout viewer's page: the data of ``view/rollout_view.py`` drawn by one script, no
network, no library. Steps × groups of samples, each a card: prompt, the tokens coloured by a
chosen quantity (log-prob, engine−trainer gap, advantage, trained or not, policy version), the
environment's text between an episode's turns set apart, tool calls listed under their turn;
filters (step, reward range, finish reason, errors), sorting, and pages of cards."""

from __future__ import annotations

import html
import json
from typing import Any

STYLE = """
body{font-family:sans-serif;margin:1.5em;max-width:1300px}
.controls{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ccc;font-size:13px}
.controls label{margin-right:10px}.controls input{width:5em}
.card{border:1px solid #ccc;border-radius:4px;margin:8px 0;padding:6px 10px;font-size:13px}
.card.error{border-left:4px solid #b33}
.head{color:#333;margin-bottom:4px}.head b{margin-right:8px}
.prompt{white-space:pre-wrap;font-family:monospace;color:#555}
.tokens{font-family:monospace;white-space:pre-wrap;line-height:1.6}
.tok{border-radius:2px;border-right:1px solid rgba(255,255,255,.7)}
.env{display:block;background:#eef3fb;border-left:3px solid #4a78c2;margin:3px 0;padding:2px 6px}
.env::before{content:'environment';display:block;font:11px sans-serif;color:#4a78c2}
.calls{margin:3px 0 0 0;padding-left:18px;color:#185a18}.calls .bad{color:#b33}
.legend{font-size:12px;color:#555}
#alarm{border-left:4px solid #b33;padding:4px 10px;margin:8px 0;background:#fdf0f0}
.card.alarmed{border-left:4px solid #d98c00}
"""

SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('data').textContent);
const $ = id => document.getElementById(id);
let page = 0;
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
function value(t, q) {
  if (!t.sampled) return null;
  if (q === 'logprob') return t.logprob;
  if (q === 'gap') return t.gap === undefined ? null : t.gap;
  if (q === 'advantage') return t.advantage === undefined ? null : t.advantage;
  if (q === 'trained') return t.trained === undefined ? null : (t.trained ? 1 : 0);
  if (q === 'version') return t.version;
  return null;
}
function colour(v, q, range) {
  if (v === null || v === undefined) return '';
  if (q === 'logprob') { const p = Math.exp(v); return `rgba(214,39,40,${(1 - p) * 0.7})`; }
  if (q === 'trained') return v ? 'rgba(44,160,44,0.35)' : 'rgba(150,150,150,0.35)';
  const scale = Math.max(Math.abs(range[0]), Math.abs(range[1]), 1e-9);
  if (q === 'version') return `rgba(31,119,180,${0.15 + 0.6 * (v - range[0]) / Math.max(range[1] - range[0], 1)})`;
  const a = Math.min(Math.abs(v) / scale, 1) * 0.7;
  return v >= 0 ? `rgba(44,160,44,${a})` : `rgba(214,39,40,${a})`;
}
function shown() {
  const step = $('step').value, lo = parseFloat($('rmin').value), hi = parseFloat($('rmax').value);
  const finish = $('finish').value, errors = $('errors').value;
  let rows = DATA.samples.filter(s =>
    (step === 'all' || s.step === +step) &&
    (isNaN(lo) || (s.reward !== null && s.reward >= lo)) &&
    (isNaN(hi) || (s.reward !== null && s.reward <= hi)) &&
    (finish === 'any' || s.finish === finish) &&
    (errors === 'any' || (errors === 'only') === s.error));
  const key = $('sort').value, sign = key.endsWith('-') ? -1 : 1, field = key.replace(/[+-]$/, '');
  if (field !== 'order') rows = rows.slice().sort((a, b) => sign * ((a[field] ?? -Infinity) - (b[field] ?? -Infinity)));
  return rows;
}
function card(s, q, range) {
  const div = document.createElement('div');
  const alarmed = DATA.alarm && s.step >= DATA.alarm.steps.after[0] && s.step <= DATA.alarm.steps.after[1];
  div.className = 'card' + (s.error ? ' error' : '') + (alarmed ? ' alarmed' : '');
  div.dataset.step = s.step; div.dataset.reward = s.reward;
  // every value comes from a run folder, anyone's: it goes on the page as text, never as markup
  const parts = s.components.map((c, i) => `${DATA.components[i] || 'reward ' + i} ${c}`).join(', ');
  const head = el('div', 'head');
  head.append(el('b', '', `step ${s.step}`), el('b', '', `group ${s.group}`), 'reward ',
    el('b', 'reward', s.error ? 'none (error)' : String(s.reward)),
    `${parts ? '(' + parts + ') ' : ''}· advantage ${s.advantage ?? '–'} · ${s.length} tokens · ${s.finish}`);
  const details = el('details');
  details.append(el('summary', '', 'prompt'), el('div', 'prompt', s.prompt));
  div.append(head, details, el('div', 'tokens'));
  const box = div.querySelector('.tokens');
  let env = null, turn = 0, inTurn = false;
  const calls = t => { const list = document.createElement('ul'); list.className = 'calls';
    for (const c of s.calls.filter(c => c.turn === t)) { const li = document.createElement('li');
      if (c.malformed) { li.className = 'bad'; li.textContent = 'malformed tool call: ' + c.malformed; }
      else li.textContent = 'tool call ' + c.name + ' ' + JSON.stringify(c.arguments);
      list.appendChild(li); }
    return list.children.length ? list : null; };
  for (const t of s.tokens) {
    if (!t.sampled) {
      if (inTurn) { const l = calls(turn); if (l) box.appendChild(l); turn++; inTurn = false; }
      if (!env) { env = document.createElement('span'); env.className = 'env'; box.appendChild(env); }
      env.appendChild(document.createTextNode(t.text)); continue;
    }
    env = null; inTurn = true;
    const span = document.createElement('span');
    span.className = 'tok'; span.textContent = t.text;
    span.style.background = colour(value(t, q), q, range);
    span.title = ['logprob', 'gap', 'advantage', 'trained', 'version']
      .filter(k => t[k] !== undefined).map(k => k + ' ' + t[k]).join('\n');
    box.appendChild(span);
  }
  if (inTurn) { const l = calls(turn); if (l) box.appendChild(l); }
  return div;
}
function draw() {
  const rows = shown(), size = $('size').value === 'all' ? rows.length || 1 : +$('size').value;
  const pages = Math.max(1, Math.ceil(rows.length / size));
  page = Math.min(page, pages - 1);
  const q = $('colour').value, values = [];
  for (const s of rows) for (const t of s.tokens) { const v = value(t, q); if (v !== null) values.push(v); }
  const range = values.length ? [Math.min(...values.slice(0, 100000)), Math.max(...values.slice(0, 100000))] : [0, 0];
  const list = $('samples'); list.replaceChildren();
  for (const s of rows.slice(page * size, (page + 1) * size)) list.appendChild(card(s, q, range));
  $('count').textContent = `${rows.length} of ${DATA.samples.length} samples · page ${page + 1} of ${pages}`;
  $('legend').textContent = q === 'none' ? '' : `colour: ${q} (range ${range[0].toFixed(3)} to ${range[1].toFixed(3)})`;
}
if (DATA.alarm) {
  const a = DATA.alarm, m = a.monitor;
  $('alarm').textContent = `Reward-hacking alarm at step ${a.step}: the optimised reward rose from ` +
    `${a.optimised.before.toFixed(3)} to ${a.optimised.after.toFixed(3)} while the monitor '${m.name}' fell from ` +
    `${m.before.toFixed(3)} to ${m.after.toFixed(3)} (steps ${a.steps.after[0]}–${a.steps.after[1]}: cards marked).`;
  $('alarm').hidden = false;
}
const steps = [...new Set(DATA.samples.map(s => s.step))];
for (const st of steps) {
  const o = document.createElement('option'); o.value = st; o.textContent = st; $('step').appendChild(o);
}
for (const id of ['step', 'rmin', 'rmax', 'finish', 'errors', 'sort', 'colour', 'size'])
  $(id).addEventListener('input', () => { page = 0; draw(); });
$('prev').addEventListener('click', () => { page = Math.max(0, page - 1); draw(); });
$('next').addEventListener('click', () => { page += 1; draw(); });
draw();
"""

CONTROLS = """
<div class="controls">
<label>step <select id="step"><option value="all">all</option></select></label>
<label>reward from <input id="rmin" type="number" step="any"> to <input id="rmax" type="number" step="any"></label>
<label>finish <select id="finish"><option>any</option><option>stop</option><option>length</option></select></label>
<label>errors <select id="errors"><option value="any">shown</option><option value="only">only</option>
<option value="none">hidden</option></select></label>
<label>sort <select id="sort"><option value="order">as sampled</option>
<option value="reward-">reward, high first</option><option value="reward+">reward, low first</option>
<option value="advantage-">advantage, high first</option>
<option value="advantage+">advantage, low first</option><option value="length-">longest first</option></select></label>
<label>colour <select id="colour"><option value="logprob">log-prob</option><option value="gap">engine − trainer</option>
<option value="advantage">advantage</option><option value="trained">trained or not</option>
<option value="version">policy version</option><option value="none">none</option></select></label>
<label>per page <select id="size"><option>50</option><option>200</option><option>all</option></select></label>
<button id="prev">◀</button><button id="next">▶</button> <span id="count"></span>
<div class="legend" id="legend"></div>
</div>
"""


def render_page(data: dict[str, Any]) -> str:
    """The whole page: ``data`` embedded as JSON with ``<``, ``>`` and ``&`` written as escapes, so no
    value can end the script or open a comment that swallows it (``<!--<script>``)."""
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = f"rollouts: {data.get('run', '')}"
    steps = data.get("steps", [])
    note = (f"{len(steps)} of {data.get('recorded_steps', len(steps))} recorded steps on this page"
            if steps else "no recorded step")  # fmt: skip
    return "\n".join(
        [
            f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
            f"<style>{STYLE}</style></head><body>",
            f"<h1>{html.escape(title)}</h1><p>{html.escape(note)}; hover a token for its numbers.</p>",
            "<div id='alarm' hidden></div>",
            CONTROLS,
            "<div id='samples'></div>",
            f"<script type='application/json' id='data'>{payload}</script>",
            f"<script>{SCRIPT}</script>",
            "</body></html>",
        ]
    )

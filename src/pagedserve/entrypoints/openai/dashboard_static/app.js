// The live engine page: renders frames from /dashboard/events and streams the
// playground's replies from /v1/chat/completions. Plain DOM, no dependencies.
"use strict";

const MAX_STEPS = 90;            // bars kept in the step chart (style.css sizes them to fit)
const $ = (id) => document.getElementById(id);

const state = {
  frame: null,
  cells: [],
  steps: [],
  chatId: null,                   // the playground request whose blocks are lit
  history: [],                    // [{role, content}] of the conversation so far
};

// -- the snapshot stream ---------------------------------------------------------------

function connect() {
  const source = new EventSource("/dashboard/events");
  source.onopen = () => setConn("open", "live");
  source.onerror = () => setConn("closed", "reconnecting…");
  source.onmessage = (event) => render(JSON.parse(event.data));
}

function setConn(kind, text) {
  const el = $("conn");
  el.dataset.state = kind;
  el.textContent = text;
}

function render(frame) {
  state.frame = frame;
  $("model").textContent = `${frame.info.model} · context ${frame.info.max_model_len} tokens`;
  const spec = frame.info.speculative;
  $("spec-mode").textContent = !spec ? "not configured" : `${spec}, ${frame.speculating ? "on" : "paused"}`;
  $("spec-switch").hidden = !spec;
  if (document.activeElement !== $("speculate")) $("speculate").checked = frame.speculating;
  renderBlocks(frame);
  for (const step of frame.steps) state.steps.push(step);
  state.steps.splice(0, Math.max(0, state.steps.length - MAX_STEPS));
  renderSteps();
  renderFigures(frame);
  renderQueues(frame.requests);
  document.body.dataset.frame = frame.frame;
}

// A stable colour per request, so a request's blocks read as one region.
function ownerColour(id) {
  const base = id.split("#")[0];
  let h = 0;
  for (let i = 0; i < base.length; i++) h = (h * 31 + base.charCodeAt(i)) >>> 0;
  return `hsl(${h % 360}, 55%, 52%)`;
}

function isChat(seqId) {
  return state.chatId !== null && (seqId === state.chatId || seqId.startsWith(state.chatId + "#"));
}

function renderBlocks(frame) {
  const map = $("block-map");
  const codes = frame.blocks.state;
  if (state.cells.length !== codes.length) {
    map.replaceChildren();
    state.cells = [];
    // Big cells for a small pool, small ones so a large pool still fits the panel.
    map.style.setProperty("--cell", codes.length <= 256 ? "20px" : codes.length <= 1024 ? "12px" : "7px");
    for (let i = 0; i < codes.length; i++) {
      const cell = document.createElement("div");
      cell.className = "cell f";
      cell.dataset.block = i;
      map.appendChild(cell);
      state.cells.push(cell);
    }
  }
  const counts = { f: 0, c: 0, u: 0, s: 0, w: 0 };
  for (let i = 0; i < codes.length; i++) {
    const code = codes[i];
    counts[code]++;
    const cell = state.cells[i];
    const owner = frame.blocks.owner[i];
    const seq = owner >= 0 ? frame.seqs[owner] : null;
    const cls = "cell " + code + (seq && isChat(seq.id) ? " lit" : "");
    if (cell.className !== cls) cell.className = cls;
    cell.dataset.state = code;
    if (code === "u" && seq) cell.style.setProperty("--owner", ownerColour(seq.id));
  }
  const stats = frame.stats;
  $("count-free").textContent = stats.kv_free_blocks;
  $("count-used").textContent = stats.kv_total_blocks - stats.kv_free_blocks;
  $("count-cached").textContent = counts.c;
  $("count-shared").textContent = counts.s;
  $("usage").textContent = pct(stats.kv_usage);
  $("waste").textContent = pct(stats.kv_waste);
  $("pool-line").textContent = `${stats.kv_total_blocks} blocks × ${frame.block_size} tokens`;
}

function showTooltip(event) {
  const tip = $("tooltip");
  const i = event.target.dataset ? event.target.dataset.block : undefined;
  if (i === undefined || !state.frame) { tip.hidden = true; return; }
  const frame = state.frame;
  const code = frame.blocks.state[i];
  const owner = frame.blocks.owner[i];
  const names = { f: "free", c: "cached, evictable", u: "in use", s: "shared", w: "copied on write" };
  let text = `block ${i}: ${names[code]}`;
  if (frame.blocks.ref[i] > 1) text += ` (ref count ${frame.blocks.ref[i]})`;
  if (owner >= 0) {
    const seq = frame.seqs[owner];
    text += `\nrequest ${seq.id}\n${seq.tokens} tokens in ${seq.blocks} blocks`;
  }
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = `${event.clientX + 12}px`;
  tip.style.top = `${event.clientY + 12}px`;
}

function renderSteps() {
  const chart = $("steps");
  chart.replaceChildren();
  for (const s of state.steps) {
    const budget = Math.max(s.budget, s.decode + s.prefill + s.draft);
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.title = `${s.rows} rows: ${s.decode} decode, ${s.prefill} prefill, ${s.draft} draft tokens of ${s.budget}; ${s.ms.toFixed(1)} ms`;
    for (const [kind, value] of [["decode", s.decode], ["prefill", s.prefill], ["draft", s.draft],
                                 ["unused", Math.max(0, s.budget - s.decode - s.prefill - s.draft)]]) {
      if (!value) continue;
      const part = document.createElement("i");
      part.className = kind;
      part.style.height = `${(100 * value) / budget}%`;
      bar.appendChild(part);
    }
    chart.appendChild(bar);
  }
  const times = state.steps.map((s) => s.ms);
  const top = Math.max(1, ...times);
  const n = state.steps.length;
  const offset = 100 - (100 * n) / MAX_STEPS;  // bars are right-aligned: so is the line
  const xs = times.map((t, i) => `${offset + ((i + 0.5) * 100) / MAX_STEPS},${27 - (25 * t) / top}`).join(" ");
  $("step-line").innerHTML = `<b>≤ ${top.toFixed(0)} ms</b><svg viewBox="0 0 100 28" preserveAspectRatio="none">`
    + `<polyline fill="none" stroke="#1d2430" stroke-width="1.5" vector-effect="non-scaling-stroke" points="${xs}"/></svg>`;
}

function renderFigures(frame) {
  const w = frame.window;
  $("m-throughput").textContent = `${w.generation_tokens_per_s.toFixed(1)} tok/s`;
  $("m-prefix").textContent = w.prefix_cache_hit_rate === null ? "–" : pct(w.prefix_cache_hit_rate);
  $("m-spec").textContent = !frame.info.speculative ? "off"
    : w.spec_acceptance === null ? "–" : pct(w.spec_acceptance);
  $("m-ttft").textContent = quantiles(w.ttft_ms);
  $("m-itl").textContent = quantiles(w.itl_ms);
  $("m-preempt").textContent = frame.stats.num_preemptions;
  $("window-note").textContent = `over the last ${w.seconds} s this page has watched`;
}

function renderQueues(requests) {
  for (const kind of ["running", "waiting", "preempted"]) {
    const list = $("q-" + kind);
    const rows = requests.filter((r) => r.state === kind);
    $("n-" + kind).textContent = rows.length;
    list.replaceChildren(...rows.map((r) => {
      const li = document.createElement("li");
      li.dataset.request = r.id;
      const label = document.createElement("code");
      // Ids are long and alike at the front (cmpl-…); the tail tells them apart.
      label.textContent = `…${r.id.slice(-6)} ${r.computed}/${r.prompt_tokens} · ${r.output_tokens}/${r.max_tokens}`;
      label.title = `${r.id}: prompt tokens computed ${r.computed}/${r.prompt_tokens}, output ${r.output_tokens}/${r.max_tokens}`;
      li.appendChild(label);
      if (r.prompt !== undefined) {
        const prompt = document.createElement("code");
        prompt.textContent = r.prompt;
        li.appendChild(prompt);
      }
      const bar = document.createElement("div");
      bar.className = "progress";
      bar.innerHTML = `<span class="p" style="width:${50 * r.computed / r.prompt_tokens}%"></span>`
        + `<span class="o" style="width:${50 * r.output_tokens / r.max_tokens}%"></span>`;
      li.appendChild(bar);
      return li;
    }));
  }
}

const pct = (x) => `${(100 * x).toFixed(1)}%`;
const quantiles = (q) => (q ? `${q.p50} / ${q.p90} / ${q.p99} ms` : "–");

// -- the playground ------------------------------------------------------------------

function chatBody(content) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content });
  const body = {
    model: state.frame ? state.frame.info.model : undefined,
    messages,
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
    n: Number($("n").value),
  };
  const schema = $("schema").value.trim();
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schema) } };
  return body;
}

async function send(event) {
  event.preventDefault();
  const content = $("message").value.trim();
  if (!content) return;
  let body;
  try {
    body = chatBody(content);
  } catch (error) {
    $("chat-status").textContent = `JSON schema: ${error.message}`;
    return;
  }
  $("send").disabled = true;
  $("chat-status").textContent = "streaming…";
  const user = document.createElement("div");
  user.className = "msg user";
  user.textContent = content;
  const reply = document.createElement("div");
  reply.className = "msg assistant";
  $("transcript").append(user, reply);
  $("message").value = "";
  const choices = [];
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(`${response.status}: ${(await response.json()).error?.message ?? ""}`);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const raw of events) {
        const data = raw.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        state.chatId = chunk.id;
        for (const c of chunk.choices) {
          if (!choices[c.index]) {
            choices[c.index] = document.createElement("div");
            choices[c.index].className = "choice";
            choices[c.index].dataset.index = c.index;
            reply.appendChild(choices[c.index]);
          }
          if (c.delta && c.delta.content) choices[c.index].textContent += c.delta.content;
          if (c.finish_reason) choices[c.index].dataset.done = "true";
        }
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
    }
    state.history.push({ role: "user", content }, { role: "assistant", content: choices[0] ? choices[0].textContent : "" });
    $("chat-status").textContent = "done";
  } catch (error) {
    $("chat-status").textContent = `error ${error.message}`;
  } finally {
    $("send").disabled = false;
  }
}

function clearChat() {
  state.history = [];
  state.chatId = null;
  $("transcript").replaceChildren();
  $("chat-status").textContent = "";
}

async function setSpeculation() {
  const response = await fetch("/dashboard/speculation", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ enabled: $("speculate").checked }),
  });
  $("chat-status").textContent = response.ok ? `speculation ${$("speculate").checked ? "on" : "paused"}` : `error ${response.status}`;
}

$("chat-form").addEventListener("submit", send);
$("speculate").addEventListener("change", setSpeculation);
$("clear").addEventListener("click", clearChat);
$("block-map").addEventListener("mousemove", showTooltip);
$("block-map").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
connect();

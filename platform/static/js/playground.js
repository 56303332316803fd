/* The chat playground: one websocket, the branch on screen in `state.messages`, Markdown via
 * TesseraMarkdown (escape-first). Frames are documented in platform/chat/consumers.py. */
(function () {
  "use strict";
  var md = window.TesseraMarkdown;
  var state = JSON.parse(document.getElementById("playground-state").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var transcript = $("transcript"), prompt = $("prompt"), sendBtn = $("send"), stopBtn = $("stop");
  var errorBox = $("chat-error"), statusDot = $("ws-status");
  var socket = null, retryMs = 500, pending = [];
  var PARAMS = ["temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed", "presence_penalty",
                "frequency_penalty"];

  // ---------------------------------------------------------------- parameters panel
  function initParams() {
    var p = state.params || {};
    PARAMS.forEach(function (name) {
      var input = $("p-" + name);
      input.value = p[name] === null || p[name] === undefined ? "" : p[name];
      var shown = $("v-" + name);
      if (shown) {
        var show = function () { shown.textContent = input.value; };
        input.addEventListener("input", show); show();
      }
    });
    $("p-stop").value = (p.stop || []).join(", ");
    showDefaultSources();
    var model = $("p-model");
    if (state.conversation && state.conversation.model) {
      if (!Array.prototype.some.call(model.options, function (o) { return o.value === state.conversation.model; })) {
        model.add(new Option(state.conversation.model, state.conversation.model));
      }
      model.value = state.conversation.model;
    }
  }

  // Each model-settable field says where its default comes from: the model's own generation
  // config, or the playground (the model sets none for it).
  function showDefaultSources() {
    var sources = state.param_sources || {}, defaults = state.param_defaults || {};
    Object.keys(sources).forEach(function (name) {
      var tag = $("s-" + name);
      if (!tag) return;
      tag.textContent = "default " + defaults[name] + (sources[name] === "model" ? ", from the model" : ", playground's");
      tag.dataset.source = sources[name];
    });
  }

  function settings() {
    var params = {};
    PARAMS.forEach(function (name) {
      var v = $("p-" + name).value.trim();
      params[name] = v === "" ? null : Number(v);
    });
    params.stop = $("p-stop").value.split(",").map(function (s) { return s.trim(); }).filter(Boolean);
    return { model: $("p-model").value, system_prompt: $("p-system").value, params: params };
  }

  // ---------------------------------------------------------------- rendering
  function streaming() {
    return state.messages.some(function (m) { return m.status === "streaming"; });
  }

  function statsText(m) {
    var s = m.stats;
    if (!s) return "";
    var parts = [];
    if (s.prompt_tokens !== null) parts.push(s.prompt_tokens + " prompt");
    if (s.completion_tokens !== null) parts.push(s.completion_tokens + " completion tokens");
    if (s.ttft_ms !== null && s.ttft_ms !== undefined) parts.push("TTFT " + Math.round(s.ttft_ms) + " ms");
    if (s.tokens_per_s) parts.push(s.tokens_per_s.toFixed(1) + " tok/s");
    if (m.status === "stopped") parts.push("stopped");
    return parts.join(" · ");
  }

  function button(label, title, onClick) {
    var b = document.createElement("button");
    b.type = "button"; b.textContent = label; b.title = title;
    b.addEventListener("click", onClick);
    return b;
  }

  function renderMessage(m, isLast) {
    var el = document.createElement("div");
    el.className = "msg " + m.role + (m.status === "streaming" ? " streaming" : "");
    el.dataset.id = m.id;
    var head = document.createElement("div");
    head.className = "role";
    head.appendChild(document.createTextNode(m.role === "user" ? "You" : "Assistant"));
    if (m.siblings && m.siblings.length > 1) {
      var nav = document.createElement("span");
      nav.className = "branch-nav";
      var i = m.sibling_index;
      if (i > 0) nav.appendChild(button("‹", "previous version", function () { selectBranch(m.siblings[i - 1]); }));
      nav.appendChild(document.createTextNode(" " + (i + 1) + "/" + m.siblings.length + " "));
      if (i < m.siblings.length - 1) nav.appendChild(button("›", "next version", function () { selectBranch(m.siblings[i + 1]); }));
      head.appendChild(nav);
    }
    var actions = document.createElement("span");
    actions.className = "actions";
    if (!streaming()) {
      if (m.role === "user") actions.appendChild(button("Edit", "edit and resend", function () { startEdit(el, m); }));
      if (m.role === "assistant" && isLast) actions.appendChild(button("Regenerate", "new answer", function () { regenerate(m); }));
    }
    head.appendChild(actions);
    el.appendChild(head);
    var body = document.createElement("div");
    body.className = "body";
    body.innerHTML = md.render(m.content);   // safe: render() escapes everything first
    el.appendChild(body);
    if (m.error) {
      var err = document.createElement("div");
      err.className = "error"; err.textContent = m.error;
      el.appendChild(err);
    }
    var stats = document.createElement("div");
    stats.className = "stats"; stats.textContent = statsText(m);
    el.appendChild(stats);
    return el;
  }

  function render() {
    transcript.textContent = "";
    if (!state.messages.length) {
      var empty = document.createElement("p");
      empty.className = "empty-state"; empty.id = "empty-state";
      empty.textContent = "Send a message to start. Answers stream in as the model writes them.";
      transcript.appendChild(empty);
    }
    state.messages.forEach(function (m, i) { transcript.appendChild(renderMessage(m, i === state.messages.length - 1)); });
    var busy = streaming();
    sendBtn.hidden = busy; stopBtn.hidden = !busy;
    transcript.scrollTop = transcript.scrollHeight;
  }

  function updateBody(m) {
    var el = transcript.querySelector('.msg[data-id="' + m.id + '"] .body');
    if (!el) return render();
    var nearBottom = transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 80;
    el.innerHTML = md.render(m.content);
    if (nearBottom) transcript.scrollTop = transcript.scrollHeight;
  }

  function showError(text) {
    errorBox.textContent = text; errorBox.hidden = !text;
  }

  // ---------------------------------------------------------------- socket
  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + state.ws_path);
    socket.onopen = function () {
      retryMs = 500;
      statusDot.classList.add("online"); statusDot.title = "connected";
      state.messages.forEach(function (m) {
        if (m.status === "streaming") socket.send(JSON.stringify({ type: "resume", message_id: m.id }));
      });
      pending.splice(0).forEach(function (f) { socket.send(JSON.stringify(f)); });
    };
    socket.onclose = function () {
      statusDot.classList.remove("online"); statusDot.title = "reconnecting…";
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 8000);
    };
    socket.onmessage = function (e) { handle(JSON.parse(e.data)); };
  }

  function send(frame) {
    showError("");
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(frame));
    else pending.push(frame);
  }

  function find(id) {
    for (var i = 0; i < state.messages.length; i++) if (state.messages[i].id === id) return i;
    return -1;
  }

  var handlers = {
    ready: function () {},
    started: function (f) {
      var isNew = !state.conversation || state.conversation.id !== f.conversation.id;
      state.conversation = Object.assign(state.conversation || {}, f.conversation);
      var u = f.user_message, at = find(u.id);
      if (at >= 0) state.messages = state.messages.slice(0, at + 1);
      else {
        var p = u.parent_id === null ? -1 : find(u.parent_id);
        state.messages = state.messages.slice(0, p + 1).concat([u]);
      }
      state.messages.push(f.message);
      if (isNew) {
        history.replaceState(null, "", "/chat/c/" + f.conversation.id + "/");
        $("chat-title").textContent = f.conversation.title || "Conversation";
        var li = document.createElement("li"), a = document.createElement("a");
        a.href = "/chat/c/" + f.conversation.id + "/"; a.textContent = f.conversation.title; a.className = "active";
        li.appendChild(a);
        var list = $("conversation-list");
        list.querySelectorAll(".muted").forEach(function (n) { n.remove(); });
        list.querySelectorAll("a.active").forEach(function (n) { n.classList.remove("active"); });
        list.prepend(li);
      }
      render();
    },
    resumed: function (f) {
      var i = find(f.message_id);
      if (i >= 0) { state.messages[i].content = ""; updateBody(state.messages[i]); }  // the replay starts over
    },
    delta: function (f) {
      var i = find(f.message_id);
      if (i < 0) return;
      state.messages[i].content += f.text;
      updateBody(state.messages[i]);
    },
    done: function (f) {
      var i = find(f.message.id);
      if (i >= 0) state.messages[i] = f.message;
      render();
      prompt.focus();
    },
    branch: function (f) { state.messages = f.messages; render(); },
    error: function (f) { showError(f.message); render(); }
  };

  function handle(frame) { (handlers[frame.type] || function () {})(frame); }

  // ---------------------------------------------------------------- actions
  function sendMessage() {
    var text = prompt.value;
    if (!text.trim() || streaming()) return;
    send({ type: "send", conversation_id: state.conversation ? state.conversation.id : null,
           content: text, settings: settings() });
    prompt.value = "";
  }

  function regenerate(m) { send({ type: "regenerate", message_id: m.id, settings: settings() }); }

  function selectBranch(id) { send({ type: "select_branch", message_id: id }); }

  function startEdit(el, m) {
    var body = el.querySelector(".body");
    var box = document.createElement("textarea");
    box.value = m.content; box.rows = Math.min(12, m.content.split("\n").length + 1);
    var row = document.createElement("div");
    row.className = "toolbar";
    row.appendChild(button("Save & send", "resend as a new branch", function () {
      if (box.value.trim()) send({ type: "edit", message_id: m.id, content: box.value, settings: settings() });
    }));
    row.appendChild(button("Cancel", "keep the message", render));
    body.textContent = "";
    body.appendChild(box); body.appendChild(row);
    box.focus();
  }

  $("composer").addEventListener("submit", function (e) { e.preventDefault(); sendMessage(); });
  prompt.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendMessage(); }
  });
  stopBtn.addEventListener("click", function () {
    var live = state.messages.filter(function (m) { return m.status === "streaming"; })[0];
    if (live) send({ type: "stop", message_id: live.id });
  });

  initParams();
  render();
  connect();
})();

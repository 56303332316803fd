/* A small, safe Markdown renderer for chat messages.
 * Safety rule: every character of the source is HTML-escaped FIRST; the only tags in the output are
 * the ones this file writes (p, br, pre, code, strong, em, h1-h6, ul, ol, li, blockquote, a with an
 * http(s) href). No raw HTML from model or user text ever reaches innerHTML. */
(function (global) {
  "use strict";

  function escapeHtml(text) {
    return String(text)
      .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Inline markup on ALREADY-ESCAPED text: `code`, **bold**, *italic*, [label](http(s)://url).
  function inline(escaped) {
    return escaped.split(/(`[^`\n]+`)/g).map(function (part, i) {
      if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
      return part
        .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
        .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()<>]+)\)/g,
          '<a href="$2" rel="noopener noreferrer nofollow" target="_blank">$1</a>');
    }).join("");
  }

  function codeBlock(lang, lines) {
    var cls = lang ? ' class="language-' + escapeHtml(lang.replace(/[^\w+-]/g, "")) + '"' : "";
    return "<pre><code" + cls + ">" + escapeHtml(lines.join("\n")) + "</code></pre>";
  }

  function listBlock(tag, items) {
    return "<" + tag + ">" + items.map(function (it) { return "<li>" + inline(escapeHtml(it)) + "</li>"; }).join("") + "</" + tag + ">";
  }

  function render(source) {
    var lines = String(source || "").replace(/\r\n?/g, "\n").split("\n");
    var out = [], para = [], i = 0;
    function flush() {
      if (para.length) out.push("<p>" + para.map(function (l) { return inline(escapeHtml(l)); }).join("<br>") + "</p>");
      para = [];
    }
    while (i < lines.length) {
      var line = lines[i], m;
      if ((m = /^\s*(`{3,}|~{3,})\s*([\w+-]*)/.exec(line))) {   // fenced code (may still be streaming)
        flush();
        var fence = m[1], body = [];
        i++;
        while (i < lines.length && lines[i].trim().indexOf(fence) !== 0) body.push(lines[i++]);
        out.push(codeBlock(m[2], body));
        i++;
        continue;
      }
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flush();
        out.push("<h" + m[1].length + ">" + inline(escapeHtml(m[2])) + "</h" + m[1].length + ">");
      } else if (/^\s*[-*+]\s+/.test(line) || /^\s*\d+[.)]\s+/.test(line)) {
        flush();
        var ordered = /^\s*\d+[.)]\s+/.test(line), items = [];
        var re = ordered ? /^\s*\d+[.)]\s+(.*)$/ : /^\s*[-*+]\s+(.*)$/;
        while (i < lines.length && (m = re.exec(lines[i]))) { items.push(m[1]); i++; }
        out.push(listBlock(ordered ? "ol" : "ul", items));
        continue;
      } else if (/^\s*>/.test(line)) {
        flush();
        var quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) { quoted.push(lines[i].replace(/^\s*>\s?/, "")); i++; }
        out.push("<blockquote>" + render(quoted.join("\n")) + "</blockquote>");
        continue;
      } else if (line.trim() === "") {
        flush();
      } else {
        para.push(line);
      }
      i++;
    }
    flush();
    return out.join("");
  }

  global.TesseraMarkdown = { render: render, escapeHtml: escapeHtml };
})(typeof window !== "undefined" ? window : globalThis);

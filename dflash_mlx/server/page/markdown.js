// Markdown for the chat page: fenced and indented code shown exactly as written (escaped,
// indentation kept, nothing inside it read as Markdown), headings, lists, quotes, **bold**,
// *italic* and `code`. Underscores are never emphasis, so `__init__` stays `__init__`.
// Every piece of text is HTML-escaped before any tag is added; links only for http(s).
(function (root) {
  "use strict";

  function escapeHtml(text) {
    return text
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  function emphasis(escaped) {
    return escaped
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w*])\*(?=[^\s*])([^*\n]*?[^\s*])?\*(?![\w*])/g, function (m, pre, body) {
        return body === undefined ? m : pre + "<em>" + m.slice(pre.length + 1, -1) + "</em>";
      })
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, function (m, label, url) {
        return '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>";
      });
  }

  // `code` spans first: what they hold is shown as is.
  function inline(text) {
    var out = "";
    var parts = text.split(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/);
    for (var i = 0; i < parts.length; i += 3) {
      out += emphasis(escapeHtml(parts[i]));
      if (i + 2 < parts.length) out += "<code>" + escapeHtml(parts[i + 2]) + "</code>";
    }
    return out;
  }

  function codeBlock(lines, lang) {
    var cls = lang ? ' class="language-' + escapeHtml(lang) + '"' : "";
    return "<pre><code" + cls + ">" + escapeHtml(lines.join("\n")) + "</code></pre>";
  }

  function render(src) {
    var lines = String(src).replace(/\r\n?/g, "\n").split("\n");
    var html = [];
    var para = [];
    var list = null; // {tag, items}

    function flushPara() {
      if (para.length) html.push('<p class="md-p">' + inline(para.join("\n")) + "</p>");
      para = [];
    }
    function flushList() {
      if (list) {
        html.push(
          "<" + list.tag + ">" +
            list.items.map(function (t) { return "<li>" + inline(t) + "</li>"; }).join("") +
            "</" + list.tag + ">"
        );
      }
      list = null;
    }
    function flush() { flushPara(); flushList(); }

    for (var i = 0; i < lines.length; i++) {
      var line = lines[i];
      var fence = /^(\s{0,3})(`{3,}|~{3,})\s*([^\s`]*)/.exec(line);
      if (fence) {
        flush();
        var marker = fence[2];
        var body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().indexOf(marker) === 0 &&
               /^\s*(`{3,}|~{3,})\s*$/.test(lines[i]))) {
          body.push(lines[i]);
          i++;
        }
        html.push(codeBlock(body, fence[3]));
        continue;
      }
      if (!para.length && !list && /^( {4}|\t)/.test(line)) { // indented code
        var block = [];
        while (i < lines.length && (/^( {4}|\t)/.test(lines[i]) || lines[i].trim() === "")) {
          block.push(lines[i].replace(/^( {4}|\t)/, ""));
          i++;
        }
        i--;
        while (block.length && block[block.length - 1].trim() === "") block.pop();
        html.push(codeBlock(block, ""));
        continue;
      }
      if (line.trim() === "") { flush(); continue; }
      var heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        flush();
        var n = heading[1].length;
        html.push("<h" + n + ">" + inline(heading[2]) + "</h" + n + ">");
        continue;
      }
      var item = /^\s{0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(line);
      if (item) {
        flushPara();
        var tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (!list || list.tag !== tag) { flushList(); list = {tag: tag, items: []}; }
        list.items.push(item[2]);
        continue;
      }
      var quote = /^\s{0,3}>\s?(.*)$/.exec(line);
      if (quote) {
        flush();
        html.push("<blockquote>" + inline(quote[1]) + "</blockquote>");
        continue;
      }
      if (list) { flushList(); }
      para.push(line);
    }
    flush();
    return html.join("\n");
  }

  var api = {render: render, escapeHtml: escapeHtml};
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.Markdown = api;
})(this);

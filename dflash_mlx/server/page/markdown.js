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

  // Streaming: a reply rendered as it grows, each settled part once (not the whole reply
  // again on every chunk, whose cost grows with the square of its length). `feed(src)`
  // takes the reply so far (each call the same text, longer) and returns `html`: the parts
  // that can no longer change, rendered, in order; and the open part: `tail` (an offset of
  // src: render src.slice(tail)), or `fence` (an open code fence: its `lang` and the offset
  // of its `body`, which only grows until the fence closes). A part is settled at a line
  // where `render` starts afresh whatever came before: before a fence, a heading or a
  // quote, after one, and before a line that starts a block after a blank line. The parts
  // joined with "\n" are render(src) (tests/test_chat_page.py checks it).
  var FENCE = /^(\s{0,3})(`{3,}|~{3,})\s*([^\s`]*)/;
  var FENCE_END = /^\s*(`{3,}|~{3,})\s*$/;
  var INDENTED = /^( {4}|\t)/;
  var ALONE = /^(#{1,6}\s|\s{0,3}>)/; // a heading or a quote: a block of one line

  function Stream() {
    this.settled = 0; // src before this offset is rendered for good
    this.scanned = 0; // the first line not scanned yet
    this.fence = null; // an open fence: {marker, lang, body}
    this.code = false; // inside an indented code block (where a fence is code too)
    this.fresh = true; // no paragraph or list open: an indented line starts code
  }

  Stream.prototype.feed = function (src) {
    var html = [];
    var self = this;
    function settle(at) {
      if (at > self.settled) {
        var part = render(src.slice(self.settled, at));
        if (part) html.push(part);
        self.settled = at;
      }
    }
    var nl;
    while ((nl = src.indexOf("\n", this.scanned)) >= 0) {
      var start = this.scanned;
      var line = src.slice(start, nl);
      this.scanned = nl + 1;
      var blank = line.trim() === "";
      if (this.fence) {
        if (line.trim().indexOf(this.fence.marker) === 0 && FENCE_END.test(line)) {
          this.fence = null;
          this.fresh = true;
          settle(this.scanned);
        }
        continue;
      }
      if (this.code) {
        if (blank || INDENTED.test(line)) continue;
        this.code = false; // this line ends the block: read afresh, as any other below
        this.fresh = true;
      }
      if (FENCE.exec(line)) {
        settle(start);
        var fence = FENCE.exec(line);
        this.fence = {marker: fence[2], lang: fence[3], body: this.scanned};
        continue;
      }
      if (blank) {
        this.fresh = true;
        continue;
      }
      if (INDENTED.test(line)) {
        if (this.fresh) this.code = true; // else a paragraph's line
        this.fresh = false;
        continue;
      }
      if (this.fresh) settle(start); // a new block after a blank line (or a settled one)
      if (ALONE.test(line)) {
        settle(start);
        settle(this.scanned);
        this.fresh = true;
        continue;
      }
      this.fresh = false;
    }
    if (this.fence) return {html: html, fence: {lang: this.fence.lang, body: this.fence.body}};
    return {html: html, tail: this.settled};
  };

  var api = {render: render, escapeHtml: escapeHtml, Stream: Stream};
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.Markdown = api;
})(this);

// A small Markdown renderer for model output, which is untrusted: it builds DOM
// nodes itself (createElement, text nodes) and never parses text as HTML, so a
// reply holding <script> or <img onerror=...> shows those characters and nothing
// more. Covered: paragraphs, headings, code fences, inline code, bold, italic,
// lists (flat), quotes, rules, and links to http(s) only.

// Quotes nest this deep, then their lines are text: a reply of 10,000 `>` had run the
// renderer out of stack, and the page with it.
const MAX_QUOTE_DEPTH = 16;

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w.+#-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
// One alternative per inline form; span() tells them apart by group number.
const INLINE = new RegExp([
  /`([^`\n]+)`/.source,                                 // 1: code
  /\*\*(.+?)\*\*|__(.+?)__/.source,                     // 2, 3: bold
  /\*([^*\s](?:[^*]*[^*\s])?)\*/.source,                // 4: italic
  /(?<!\w)_([^_\s](?:[^_]*[^_\s])?)_(?!\w)/.source,     // 5: italic, not snake_case
  // 6, 7: [label](url), the url with balanced parentheses (a Wikipedia "Foo_(bar)")
  /\[([^\]\n]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/.source,
  // 8: a bare URL, parentheses only balanced, not ending in punctuation
  /(https?:\/\/(?:[^\s<>()]|\([^\s<>()]*\))*(?:[^\s<>().,;:!?'"]|\([^\s<>()]*\)))/.source,
].join('|'), 'g');

/** Replace `container`'s children with `text` rendered as Markdown; as plain text if
 * the renderer fails, so that no reply can stop the page. */
export function renderMarkdown(container, text) {
  let nodes;
  try {
    nodes = blocks(text.split('\n'));
  } catch (error) {
    console.warn('ruvllm: a reply shown as plain text, its Markdown failed:', error);
    container.textContent = text;
    return;
  }
  container.replaceChildren(...nodes);
}

function blocks(lines, depth = 0) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      i = codeBlock(lines, i, match, out);
    } else if ((match = HEADING.exec(line))) {
      out.push(inline(el(`h${Math.min(match[1].length + 2, 6)}`), match[2]));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(el('hr'));
      i += 1;
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (QUOTE.test(line) && depth < MAX_QUOTE_DEPTH) {
      i = quote(lines, i, out, depth);
    } else {
      i = paragraph(lines, i, out, depth);
    }
  }
  return out;
}

function codeBlock(lines, start, match, out) {
  const body = [];
  let i = start + 1;
  // An unclosed fence (a reply still streaming) runs to the end.
  // Closed by a line of the same character, at least as long (CommonMark): a 4-backtick
  // block that shows Markdown holds 3-backtick lines.
  const fence = match[1];
  const closes = (text) => text.length >= fence.length && text === fence[0].repeat(text.length);
  while (i < lines.length && !closes(lines[i].trim())) {
    body.push(lines[i]);
    i += 1;
  }
  const code = el('code');
  code.textContent = body.join('\n');
  if (match[2]) code.dataset.lang = match[2];
  const pre = el('pre');
  pre.append(code);
  out.push(pre);
  return i + 1;
}

/** A list: its items, across blank lines while the next item is of its kind; an
 * ordered one starts at its first number (steps split by a code block go on 2., 3.,
 * where each had restarted at 1). */
function list(lines, start, out) {
  const first = ITEM.exec(lines[start])[1];
  const ordered = /\d/.test(first);
  const node = el(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first, 10) !== 1) node.start = parseInt(first, 10);
  const item = (k) => {   // line k's item match where it is one of this list's kind
    const match = k < lines.length && ITEM.exec(lines[k]);
    return match && /\d/.test(match[1]) === ordered ? match : null;
  };
  let i = start;
  for (let match = item(i); match; match = item(i)) {
    node.append(inline(el('li'), match[2]));
    i += 1;
    let next = i;
    while (next < lines.length && !lines[next].trim()) next += 1;
    if (item(next)) i = next;   // blank lines between two of its items
  }
  out.push(node);
  return i;
}

function quote(lines, start, out, depth) {
  const body = [];
  let i = start;
  let match;
  while (i < lines.length && (match = QUOTE.exec(lines[i]))) {
    body.push(match[1]);
    i += 1;
  }
  const node = el('blockquote');
  node.append(...blocks(body, depth + 1));
  out.push(node);
  return i;
}

function paragraph(lines, start, out, depth) {
  const node = el('p');
  let i = start;
  // Past the deepest quote a quote line is text (blocks() sends it here)
  while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], depth)) {
    if (i > start) node.append(el('br'));
    inline(node, lines[i]);
    i += 1;
  }
  out.push(node);
  return i;
}

function startsBlock(line, depth = 0) {
  return [FENCE, HEADING, ITEM, RULE].some((pattern) => pattern.test(line))
    || (depth < MAX_QUOTE_DEPTH && QUOTE.test(line));
}

/** Append `text`'s inline Markdown to `parent` (returned). */
function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(last, m.index));
    parent.append(span(m));
    last = m.index + m[0].length;
  }
  parent.append(text.slice(last));
  return parent;
}

function span(m) {
  if (m[1] !== undefined) return withText(el('code'), m[1]);
  if (m[2] !== undefined || m[3] !== undefined) return inline(el('strong'), m[2] ?? m[3]);
  if (m[4] !== undefined || m[5] !== undefined) return inline(el('em'), m[4] ?? m[5]);
  if (m[6] !== undefined) return link(m[6], m[7], m[0]);
  return link(m[8], m[8], m[0]);
}

function link(label, target, source) {
  const url = safeUrl(target);
  if (!url) return document.createTextNode(source);
  const a = withText(el('a'), label);
  a.href = url;
  a.target = '_blank';
  a.rel = 'noopener noreferrer nofollow';
  return a;
}

/** `text` as an absolute http(s) URL, or null: no javascript:, data: or relative links. */
export function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === 'http:' || url.protocol === 'https:' ? url.href : null;
  } catch {
    return null;
  }
}

function el(tag) {
  return document.createElement(tag);
}

function withText(node, text) {
  node.textContent = text;
  return node;
}

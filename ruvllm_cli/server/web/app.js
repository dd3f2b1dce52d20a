// The chat page: conversations on the left, the reply streaming in as the server
// sends it (a reasoning model's reasoning folded above its answer), settings on the
// right. Every model text goes through renderMarkdown or textContent, never through
// innerHTML.

import { Api, ApiError } from './api.js';
import { renderMarkdown } from './markdown.js';
import * as store from './store.js';

const $ = (id) => document.getElementById(id);
const ui = {
  chats: $('chats'), messages: $('messages'), input: $('input'), send: $('send'), stop: $('stop'),
  model: $('model'), notice: $('notice'), settings: $('settings'), form: $('settings-form'),
  settingsError: $('settings-error'), keyDialog: $('key-dialog'), keyForm: $('key-form'),
  key: $('key'), remember: $('remember'), keyError: $('key-error'),
};
const state = {
  chats: store.loadChats(true), chat: null, settings: store.loadSettings(), key: store.loadKey(),
  controller: null, sending: false, pending: '', savedAt: 0, needsKey: false, modelsRetry: 0, unsaved: false,
  models: [], badInput: '',
};
const api = new Api(() => state.key);
const views = new WeakMap();   // message -> its <article>, kept out of what is saved

// ---- conversations ----------------------------------------------------------------
function openChat(chat) {
  if (!state.chats.includes(chat)) state.chats.unshift(chat);
  state.chat = chat;
  store.saveActive(chat.id);
  renderChats();
  ui.messages.replaceChildren(...chat.messages.map(messageView));
  scrollToEnd(true);
}

function saveChats() {
  // A conversation nobody wrote in is not worth a line in the list.
  const saved = store.saveChats(state.chats.filter((c) => c.messages.length));
  // Said while saving fails (it had failed in silence, and a reload lost the replies)
  if (!saved) {
    notice('This browser\'s storage for the page is full: new messages are not saved and a reload loses them. '
           + 'Delete old conversations (×) to make room.');
  } else if (state.unsaved) {
    notice('');
  }
  state.unsaved = !saved;
}

/** Another tab saved its conversations: take its new and changed ones, drop the ones
 * it deleted (each tab writes its whole list, so without this the last writer wins). */
function mergeChats() {
  const theirs = store.loadChats();
  const busy = state.controller ? state.chat : null;   // streaming here: ours is newer
  const byId = new Map(state.chats.map((c) => [c.id, c]));
  const shown = state.chat ? JSON.stringify(state.chat.messages) : null;
  const merged = theirs.map((chat) => {
    const ours = byId.get(chat.id);
    if (!ours) return chat;
    if (ours !== busy) Object.assign(ours, { title: chat.title, messages: chat.messages });
    return ours;
  });
  const kept = new Set(merged);
  for (const chat of state.chats) {
    if (!kept.has(chat) && (chat === busy || chat === state.chat)) merged.unshift(chat);
  }
  state.chats = merged;
  renderChats();
  // Redrawn only when it changed: another tab streaming its own chat had redrawn this one
  // every second, closing an opened "Thought" and clearing a selection
  if (state.chat !== busy && JSON.stringify(state.chat.messages) !== shown) {
    ui.messages.replaceChildren(...state.chat.messages.map(messageView));
  }
}

function renderChats() {
  ui.chats.replaceChildren(...state.chats.filter((c) => c.messages.length || c === state.chat).map(chatItem));
}

function chatItem(chat) {
  const open = button(chat.title || 'New chat', 'open', () => {
    openChat(chat);
    document.body.classList.remove('show-chats');   // on a phone the list covers the chat
  });
  if (chat === state.chat) open.setAttribute('aria-current', 'true');
  const remove = button('×', 'delete', () => deleteChat(chat));
  remove.setAttribute('aria-label', `Delete “${chat.title || 'New chat'}”`);
  const li = document.createElement('li');
  li.append(open, remove);
  return li;
}

function deleteChat(chat) {
  if (chat === state.chat && state.controller) return;
  state.chats = state.chats.filter((c) => c !== chat);
  saveChats();
  if (chat === state.chat) openChat(state.chats[0] ?? store.newChat());
  else renderChats();
}

// ---- messages -----------------------------------------------------------------------
function messageView(message) {
  const view = document.createElement('article');
  view.className = `message ${message.role}`;
  view.dataset.state = message.state ?? 'done';
  const body = document.createElement('div');
  body.className = 'body';
  const stats = document.createElement('p');
  stats.className = 'stats';
  view.append(body, stats);
  views.set(message, view);
  updateView(message);
  return view;
}

function updateView(message) {
  const view = views.get(message);
  if (!view) return;   // its conversation is not the one on screen
  const body = view.querySelector(':scope > .body');
  if (message.role === 'assistant') {
    updateThinking(view, message);
    renderMarkdown(body, message.content);
    updateCalls(view, message);
  } else {
    body.textContent = message.content;
  }
  view.querySelector(':scope > .stats').textContent = message.stats ?? '';
  view.dataset.state = message.state ?? 'done';
}

/** A reasoning model's reasoning, above its answer: folded (the answer is what was
 * asked for; a click shows how it came) and plain text (model output, not written to
 * be read as Markdown). A reply without reasoning, or saved before the page showed
 * it, gets no section. */
function updateThinking(view, message) {
  if (!message.reasoning) return;
  let details = view.querySelector(':scope > .thinking');
  if (!details) {
    details = document.createElement('details');
    details.className = 'thinking';
    const text = document.createElement('div');
    text.className = 'reasoning';
    details.append(document.createElement('summary'), text);
    view.prepend(details);   // created once: the user's open or closed stays as it streams
  }
  const [summary, text] = details.children;
  summary.textContent = message.state === 'streaming' && !message.content ? 'Thinking…' : 'Thought';
  text.textContent = message.reasoning;
}

/** Tool calls a reply made (tools and tool_choice given as extra request fields): each
 * as its name and arguments, in plain text under the reply's text. The page runs no
 * tools, so they stay out of later requests, as the text of an empty reply does. */
function updateCalls(view, message) {
  if (!message.toolCalls?.length) return;
  let list = view.querySelector(':scope > .calls');
  if (!list) {
    list = document.createElement('div');
    list.className = 'calls';
    view.querySelector(':scope > .body').after(list);
  }
  list.replaceChildren(...message.toolCalls.map((call) => {
    const line = document.createElement('pre');
    line.className = 'call';
    line.textContent = `${call.name}(${call.arguments})`;
    return line;
  }));
}

function scrollToEnd(force = false) {
  const box = ui.messages;
  const near = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  if (force || near) box.scrollTop = box.scrollHeight;
}

// ---- sending ------------------------------------------------------------------------
async function send() {
  const text = ui.input.value.trim();
  if (!text || state.controller || state.sending) return;
  // One send at a time, from the first key press: a second Enter while the model list
  // loaded had sent the message twice, and Stop reached only the second reply.
  state.sending = true;
  try {
    await sendText(text);
  } finally {
    state.sending = false;
  }
}

async function sendText(text) {
  if (!ui.model.value && state.needsKey) {   // the key dialog was dismissed: ask again, not "no model"
    state.pending = text;
    askKey();
    return;
  }
  if (!ui.model.value) {   // the list did not load (yet): ask again now; the text stays in the box
    await loadModels();
    if (!ui.model.value) return;
  }
  let body;
  try {
    body = requestBody([...history(), { role: 'user', content: text }]);
  } catch (error) {
    showSettingsError(error.message);
    return;
  }
  ui.input.value = '';
  autosize();
  const chat = state.chat;
  const user = addMessage(chat, { role: 'user', content: text });
  const reply = addMessage(chat, { role: 'assistant', content: '', state: 'streaming' });
  chat.title ||= text.slice(0, 60);
  renderChats();
  saveChats();   // the message is kept even if the tab closes mid-reply
  await streamReply(chat, body, reply, user, text);
}

function addMessage(chat, message) {
  chat.messages.push(message);
  if (chat === state.chat) {
    ui.messages.append(messageView(message));
    scrollToEnd(true);
  }
  return message;
}

async function streamReply(chat, body, reply, user, text) {
  state.controller = new AbortController();
  setBusy(true);
  const clock = { start: performance.now(), first: null, end: null };
  try {
    const { usage, finish } = await readReply(body, reply, clock);
    clock.end = performance.now();
    reply.state = 'done';
    reply.stats = statsLine(clock, usage, finish);
  } catch (error) {
    clock.end = performance.now();
    if (error instanceof ApiError && error.status === 401) return unsent(chat, [user, reply], text);
    failed(reply, error, clock);
    // A failed turn stays on screen but out of later requests (history); its text goes
    // back to an empty input box, to edit and send again.
    if (reply.state === 'error' && !ui.input.value) {
      ui.input.value = text;
      autosize();
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  updateView(reply);
  saveChats();
  scrollToEnd();
}

/** Stream the reply to `body` into `reply`; its usage and finish reason. */
async function readReply(body, reply, clock) {
  let usage = null;
  let finish = null;
  for await (const chunk of api.chat(body, state.controller.signal)) {
    usage = chunk.usage ?? usage;
    // One bubble is one reply: with `n` > 1 (an extra request field) the first choice
    // is shown, not every choice's deltas run together.
    for (const choice of (chunk.choices ?? []).filter((c) => (c.index ?? 0) === 0)) {
      // The server sends reasoning twice, as `reasoning` and as `reasoning_content`
      // (the older name): one of them is taken.
      const thought = choice.delta?.reasoning ?? choice.delta?.reasoning_content ?? '';
      const piece = choice.delta?.content ?? '';
      const calls = choice.delta?.tool_calls ?? [];
      if (thought) reply.reasoning = (reply.reasoning ?? '') + thought;
      if (piece) reply.content += piece;
      for (const call of calls) {   // OpenAI's streamed form: the name first, the arguments in pieces
        reply.toolCalls ??= [];
        const known = (reply.toolCalls[call.index ?? 0] ??= { name: '', arguments: '' });
        known.name += call.function?.name ?? '';
        known.arguments += call.function?.arguments ?? '';
      }
      if (thought || piece || calls.length) {
        clock.first ??= performance.now();
        redraw(reply);
        saveSoon();
      }
      finish = choice.finish_reason ?? finish;
    }
  }
  return { usage, finish };
}

function failed(reply, error, clock) {
  if (state.controller.signal.aborted) {
    // The server sees the connection close and cancels the request; no usage comes.
    reply.state = 'stopped';
    reply.stats = `stopped after ${seconds(clock.end - clock.start)}`;
  } else {
    reply.state = 'error';
    reply.stats = `error: ${error.message}`;
    if (error.code === 'model_not_found') loadModels();
    // The page cannot shorten the history it sends: "reduce the length of the messages"
    // was a dead end for every later turn.
    if (error.code === 'context_length_exceeded' && state.chat.messages.length > 2) {
      reply.stats += ' Start a new chat to go on (this one no longer fits the model\'s context).';
    }
  }
}

/** A request the server refused for want of a key: take it back and ask for one. */
function unsent(chat, messages, text) {
  chat.messages = chat.messages.filter((m) => !messages.includes(m));
  for (const m of messages) views.get(m)?.remove();
  if (!chat.messages.length) chat.title = '';
  state.pending = text;
  ui.input.value = text;
  askKey();
}

/** Save the reply as it streams, at most once a second (a reload keeps what came). */
function saveSoon() {
  const now = performance.now();
  if (now - state.savedAt < 1000) return;
  state.savedAt = now;
  saveChats();
}

let redrawing = null;
function redraw(message) {
  // Markdown is re-rendered whole at most once a frame, however fast chunks come.
  if (redrawing === message) return;
  redrawing = message;
  requestAnimationFrame(() => {
    redrawing = null;
    updateView(message);
    scrollToEnd();
  });
}

function statsLine(clock, usage, finish) {
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  const decoding = (clock.end - (clock.first ?? clock.end)) / 1000;
  // The first token's time is the prompt's; the rate is over the tokens after it.
  if (usage && usage.completion_tokens > 1 && decoding > 0) {
    parts.push(`${((usage.completion_tokens - 1) / decoding).toFixed(1)} tok/s`);
  }
  if (clock.first !== null) parts.push(`first token ${seconds(clock.first - clock.start)}`);
  if (usage) parts.push(`prompt ${usage.prompt_tokens} tokens`);
  if (finish === 'length') parts.push('cut at max tokens');
  if (finish === 'tool_calls') parts.push('called a tool (the page runs none)');
  return parts.join(' · ') || `${seconds(clock.end - clock.start)}, no text`;
}

function seconds(ms) {
  return `${(ms / 1000).toFixed(2)} s`;
}

/** The conversation as the next request sends it: a turn whose reply failed or never
 * came (an error, a stop before the first token, a reply that never got past its
 * reasoning) is left out; sent again, it would fail again (a prompt too long) or break
 * the alternation of roles templates require. */
function history() {
  const system = state.settings.system.trim();
  const messages = state.chat.messages;
  const turns = [];
  for (let i = 0; i < messages.length; i += 1) {
    const message = messages[i];
    const reply = messages[i + 1];
    if (message.role !== 'user') continue;
    if (reply?.role !== 'assistant' || !reply.content || reply.state === 'error') continue;
    turns.push(sendable(message), sendable(reply));
  }
  return system ? [{ role: 'system', content: system }, ...turns] : turns;
}

// A reply's reasoning stays on the page, out of requests: the reasoning models' own
// templates (DeepSeek-R1, QwQ, Qwen3) leave earlier turns' reasoning out of the prompt.
// Its text goes back as it came, a NUL included (the server takes NUL as text now).
function sendable(message) {
  return { role: message.role, content: message.content };
}

/** The chat completion request for `messages`; throws on a setting that does not parse. */
function requestBody(messages) {
  if (!ui.model.value) throw new Error('No model to talk to yet: the model list did not load.');
  return {
    ...settingsFields(), model: ui.model.value, messages, stream: true, stream_options: { include_usage: true },
  };
}

/** The request fields the settings panel sets; extra fields first, so the panel's own win. */
function settingsFields() {
  if (state.badInput) throw new Error(`${state.badInput}: a number is needed`);
  const s = state.settings;
  const body = { ...jsonSetting(s.extra, 'Extra request fields') };
  setNumber(body, 'temperature', s.temperature, 'Temperature');
  setNumber(body, 'max_tokens', s.maxTokens, 'Max tokens', true);
  setNumber(body, 'seed', s.seed, 'Seed', true);
  const schema = jsonSetting(s.schema, 'JSON schema');
  if (schema) {
    const name = String(schema.title ?? 'reply').replace(/[^A-Za-z0-9_-]/g, '_').slice(0, 64) || 'reply';
    body.response_format = { type: 'json_schema', json_schema: { name, schema, strict: true } };
  }
  return body;
}

function jsonSetting(text, what) {
  if (!text.trim()) return null;
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new Error(`${what}: not JSON (${error.message})`);
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new Error(`${what}: must be a JSON object`);
  }
  return value;
}

/** A number setting into `body` (left out when empty); throws on one that is not a
 * number, or not a whole one where `integer` (parseInt had read 1.7 as 1, 1e30 as 1). */
function setNumber(body, name, text, what, integer = false) {
  const raw = String(text).trim();
  if (!raw) return;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
    throw new Error(`${what}: ${integer ? 'a whole number' : 'a number'} is needed, not “${raw}”`);
  }
  body[name] = value;
}

function stop() {
  state.controller?.abort();
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  document.body.classList.toggle('busy', busy);
}

// ---- models ---------------------------------------------------------------------------
// While the server answers 503 (its model still loading, or it is starting), the list
// is asked for again this often: a page opened during the load had stayed without
// models until it was reloaded.
const MODELS_RETRY_MS = 2000;

async function loadModels() {
  clearTimeout(state.modelsRetry);
  try {
    fillModels(await api.models());
    state.needsKey = false;
    notice('');
  } catch (error) {
    state.needsKey = error instanceof ApiError && error.status === 401;
    if (state.needsKey) askKey();
    else notice(`Could not list the models: ${error.message}`);
    if (error instanceof ApiError && error.status === 503) {
      state.modelsRetry = setTimeout(loadModels, MODELS_RETRY_MS);
    }
  }
}

/** Base models as options; LoRA adapters (`parent` = their base) grouped under it. */
function fillModels(models) {
  state.models = models;
  // One option per model: a model served under several names (an alias and its path)
  // shares one `root`, and its first name stands for it.
  const roots = new Set();
  const bases = models.filter((m) => !m.parent && !roots.has(m.root ?? m.id) && roots.add(m.root ?? m.id));
  const options = bases.map((m) => option(m.id, m.id));
  const parents = [...new Set(models.filter((m) => m.parent).map((m) => m.parent))];
  for (const parent of parents) {
    const group = document.createElement('optgroup');
    group.label = `Adapters of ${parent}`;
    group.append(...models.filter((m) => m.parent === parent).map((m) => option(m.id, `${m.id} (LoRA)`)));
    options.push(group);
  }
  ui.model.replaceChildren(...options);
  const ids = [...bases, ...models.filter((m) => m.parent)].map((m) => m.id);
  ui.model.value = ids.includes(state.settings.model) ? state.settings.model : ids[0] ?? '';
  showMaxTokensDefault();
}

/** The model's own default in the Max tokens field: the server's cap, or what the
 * model's context leaves if that is less (kept to the first model's before). */
function showMaxTokensDefault() {
  const chosen = state.models.find((m) => m.id === ui.model.value);
  const cap = chosen?.max_tokens_default?.['/v1/chat/completions'];
  const context = chosen?.max_model_len;
  ui.form.elements.maxTokens.placeholder = cap == null ? '' : String(context ? Math.min(cap, context) : cap);
}

function option(value, label) {
  const node = document.createElement('option');
  node.value = value;
  node.textContent = label;
  return node;
}

function notice(text) {
  ui.notice.textContent = text;
  ui.notice.hidden = !text;
}

// ---- API key --------------------------------------------------------------------------
function askKey(message = '') {
  ui.key.value = state.key;
  ui.keyError.textContent = message;
  ui.keyError.hidden = !message;
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.key.focus();
}

async function submitKey(event) {
  event.preventDefault();
  state.key = ui.key.value.trim();
  try {
    fillModels(await api.models());
  } catch (error) {
    return askKey(error.status === 401 ? 'The server did not accept this key.' : error.message);
  }
  store.saveKey(state.key, ui.remember.checked);
  state.needsKey = false;
  ui.keyDialog.close();
  notice('');
  if (state.pending && ui.input.value.trim() === state.pending) send();
  state.pending = '';
}

// ---- settings -------------------------------------------------------------------------
function fillSettings() {
  for (const [name, value] of Object.entries(state.settings)) {
    const field = ui.form.elements[name];
    if (field) field.value = value;
  }
}

function readSettings() {
  state.badInput = '';
  for (const name of Object.keys(store.DEFAULT_SETTINGS)) {
    const field = ui.form.elements[name];
    if (!field) continue;
    state.settings[name] = field.value;
    // A number field the browser cannot read ("100-") gives '' as its value: said, not
    // left out of the request in silence
    if (field.validity?.badInput) state.badInput ||= field.labels?.[0]?.textContent?.trim() || name;
  }
  state.settings.model = ui.model.value;
  showMaxTokensDefault();
  store.saveSettings(state.settings);
  try {
    settingsFields();
    showSettingsError('');
  } catch (error) {
    showSettingsError(error.message);
  }
}

function showSettingsError(text) {
  ui.settingsError.textContent = text;
  ui.settingsError.hidden = !text;
  if (text) togglePanel(true);
}

function togglePanel(open = ui.settings.hidden) {
  ui.settings.hidden = !open;
  $('toggle-settings').setAttribute('aria-expanded', String(open));
}

// ---- wiring ---------------------------------------------------------------------------
function button(text, className, onClick) {
  const node = document.createElement('button');
  node.type = 'button';
  node.className = className;
  node.textContent = text;
  node.addEventListener('click', onClick);
  return node;
}

function autosize() {
  if (CSS.supports('field-sizing', 'content')) return;
  ui.input.style.height = 'auto';
  ui.input.style.height = `${ui.input.scrollHeight}px`;
}

function onKey(event) {
  if (event.key === 'Escape' && state.controller) {
    event.preventDefault();
    stop();
  } else if (event.key === 'Escape' && document.body.classList.contains('show-chats')) {
    document.body.classList.remove('show-chats');   // a phone's list covers its own button
  } else if (event.target === ui.input && event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
}

function wire() {
  $('composer').addEventListener('submit', (event) => { event.preventDefault(); send(); });
  ui.stop.addEventListener('click', stop);
  ui.input.addEventListener('input', autosize);
  document.addEventListener('keydown', onKey);
  ui.form.addEventListener('input', readSettings);
  ui.model.addEventListener('change', readSettings);
  ui.keyForm.addEventListener('submit', submitKey);
  $('forget-key').addEventListener('click', () => { state.key = ''; store.saveKey('', false); ui.key.value = ''; });
  $('change-key').addEventListener('click', () => askKey());
  $('new-chat').addEventListener('click', () => {
    openChat(store.newChat());
    document.body.classList.remove('show-chats');   // on a phone the list covers the chat
    ui.input.focus();
  });
  window.addEventListener('storage', (event) => { if (event.key === store.CHATS) mergeChats(); });
  $('toggle-settings').addEventListener('click', () => togglePanel());
  $('close-settings').addEventListener('click', () => togglePanel(false));
  $('toggle-chats').addEventListener('click', () => document.body.classList.toggle('show-chats'));
  // On a phone the open list covers the chat, and its own button: a tap outside it closes it
  document.addEventListener('click', (event) => {
    if (document.body.classList.contains('show-chats') && !event.target.closest?.('#sidebar, #toggle-chats')) {
      document.body.classList.remove('show-chats');
    }
  });
}

function start() {
  wire();
  fillSettings();
  const active = state.chats.find((c) => c.id === store.loadActive());
  openChat(active ?? store.newChat());
  loadModels();
  ui.input.focus();
}

start();

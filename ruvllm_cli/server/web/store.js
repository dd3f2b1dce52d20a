// What the page remembers, in this browser only: conversations and settings in
// localStorage, the API key in sessionStorage (this tab) unless the user asks for
// localStorage. Nothing of it is ever sent anywhere but this server's API.

export const CHATS = 'ruvllm.chats';
const ACTIVE = 'ruvllm.active';
const SETTINGS = 'ruvllm.settings';
const KEY = 'ruvllm.apiKey';

export const DEFAULT_SETTINGS = {
  model: '', system: '', temperature: '', maxTokens: '', seed: '', schema: '', extra: '',
};

function read(storage, name, fallback) {
  try {
    const value = JSON.parse(storage.getItem(name));
    return value ?? fallback;
  } catch {
    return fallback;   // a value another version wrote, or storage turned off
  }
}

/** Whether `value` was stored: false when the storage is full or turned off (the page
 * still works, it just forgets on reload; the caller says so). */
function write(storage, name, value) {
  try {
    storage.setItem(name, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

const ROLES = new Set(['user', 'assistant']);
const STATES = new Set(['done', 'stopped', 'error', 'streaming']);

/** A stored message in the shape the page draws, or null: stored data that parses as
 * JSON but holds something else (another version's, a hand edit) had stopped the page
 * from starting, or made Send do nothing. */
function message(value, startup) {
  if (!value || typeof value !== 'object' || !ROLES.has(value.role) || typeof value.content !== 'string') return null;
  const kept = { role: value.role, content: value.content };
  if (typeof value.reasoning === 'string') kept.reasoning = value.reasoning;
  if (typeof value.stats === 'string') kept.stats = value.stats;
  if (STATES.has(value.state)) kept.state = value.state;
  if (Array.isArray(value.toolCalls)) {
    kept.toolCalls = value.toolCalls.filter((c) => c && typeof c.name === 'string' && typeof c.arguments === 'string');
  }
  if (kept.state === 'streaming') {   // saved mid-reply: by a tab closed or reloaded then, or another tab
    kept.state = 'stopped';
    // On opening, said (an empty one had shown as nothing at all); another tab's may still be coming
    if (startup) kept.stats ||= 'cut off: the page was closed or reloaded during this reply';
  }
  return kept;
}

/** The stored conversations; `startup`: the page is opening (a reply left streaming was
 * cut off by a reload, not being written by another tab). */
export function loadChats(startup = false) {
  const chats = read(localStorage, CHATS, []);
  if (!Array.isArray(chats)) return [];
  return chats.filter((c) => c && typeof c === 'object' && typeof c.id === 'string' && Array.isArray(c.messages))
    .map((c) => ({ id: c.id, title: typeof c.title === 'string' ? c.title : '',
                   messages: c.messages.map((m) => message(m, startup)).filter(Boolean) }));
}

export function saveChats(chats) {
  return write(localStorage, CHATS, chats);
}

export function loadActive() {
  return read(localStorage, ACTIVE, null);
}

export function saveActive(id) {
  write(localStorage, ACTIVE, id);
}

export function newChat() {
  return { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: '', messages: [] };
}

export function loadSettings() {
  const stored = read(localStorage, SETTINGS, {});
  const settings = { ...DEFAULT_SETTINGS };
  for (const name of Object.keys(DEFAULT_SETTINGS)) {   // strings only: the fields and requests read them so
    const value = stored?.[name];
    if (typeof value === 'string') settings[name] = value;
    else if (typeof value === 'number' && Number.isFinite(value)) settings[name] = String(value);
  }
  return settings;
}

export function saveSettings(settings) {
  write(localStorage, SETTINGS, settings);
}

export function loadKey() {
  return read(sessionStorage, KEY, null) ?? read(localStorage, KEY, '');
}

/** Keep `key` for this tab, or on this device when `remember`; '' forgets it. */
export function saveKey(key, remember) {
  for (const storage of [sessionStorage, localStorage]) storage.removeItem(KEY);
  if (key) write(remember ? localStorage : sessionStorage, KEY, key);
}

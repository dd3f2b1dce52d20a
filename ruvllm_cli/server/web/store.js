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

function write(storage, name, value) {
  try {
    storage.setItem(name, JSON.stringify(value));
  } catch {
    // full or disabled: the page still works, it just forgets on reload
  }
}

export function loadChats() {
  const chats = read(localStorage, CHATS, []);
  if (!Array.isArray(chats)) return [];
  for (const message of chats.flatMap((c) => c?.messages ?? [])) {
    if (message.state === 'streaming') message.state = 'stopped';   // saved mid-reply by another tab
  }
  return chats.filter((c) => c && Array.isArray(c.messages));
}

export function saveChats(chats) {
  write(localStorage, CHATS, chats);
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
  return { ...DEFAULT_SETTINGS, ...read(localStorage, SETTINGS, {}) };
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

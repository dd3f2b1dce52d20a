// The server's own OpenAI API, called like any other client would. URLs are
// relative to the page, so a proxy may serve it under a path prefix.

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class Api {
  /** `getKey()`: the API key to send, or '' for none. */
  constructor(getKey) {
    this.getKey = getKey;
  }

  async models() {
    const response = await this.call('v1/models', {});
    return (await response.json()).data;
  }

  /** The chunks of a streamed chat completion, until [DONE]; `signal` aborts it. */
  async *chat(body, signal) {
    const response = await this.call('v1/chat/completions', {
      method: 'POST', body: JSON.stringify(body), signal, headers: { 'Content-Type': 'application/json' },
    });
    for await (const data of events(response.body)) {
      if (data.error) throw new ApiError(0, data.error.message, data.error.code);
      yield data;
    }
  }

  async call(url, init) {
    const headers = { ...init.headers };
    const key = this.getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(url, { ...init, headers, cache: 'no-store' });
    if (!response.ok) throw await errorOf(response);
    return response;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch {
    // not our JSON error (a proxy's page): the status line says enough
  }
  return new ApiError(response.status, message, code);
}

/** The JSON of each server-sent event's data, as it arrives. */
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll('\r\n', '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const data = dataOf(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (data === '[DONE]') return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});   // a consumer that stops early closes the stream
  }
}

function dataOf(event) {
  return event.split('\n').filter((line) => line.startsWith('data:'))
    .map((line) => line.slice(5).replace(/^ /, '')).join('\n');
}

// The portal's one door to the API: the key from the browser session, JSON in and out, the
// API's error body turned into an Error that says what the server said.

const KEY = "sandgate.key";

export function savedKey(): string | null {
  return sessionStorage.getItem(KEY);
}

export function saveKey(key: string): void {
  sessionStorage.setItem(KEY, key);
}

export function forgetKey(): void {
  sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

function headers(extra: Record<string, string> = {}): Record<string, string> {
  const key = savedKey();
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

async function failure(response: Response): Promise<ApiError> {
  let code = "http_" + response.status;
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) {
      code = body.error.code ?? code;
      message = body.error.message;
    } else if (Array.isArray(body?.detail)) {
      message = body.detail.map((d: { loc?: unknown[]; msg?: string }) =>
        `${(d.loc ?? []).slice(1).join(".")}: ${d.msg}`).join("; ");
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, code, message);
}

export async function call<T>(method: string, path: string, body?: unknown): Promise<T> {
  const init: RequestInit = { method, headers: headers() };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers = headers({ "Content-Type": "application/json" });
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  if (response.status === 204) return undefined as T;
  return (await response.json()) as T;
}

export const get = <T>(path: string) => call<T>("GET", path);
export const post = <T>(path: string, body?: unknown) => call<T>("POST", path, body ?? {});
export const put = <T>(path: string, body?: unknown) => call<T>("PUT", path, body);
export const del = (path: string) => call<void>("DELETE", path);

// a raw body (a file's bytes, a process's stdin), not JSON
export async function send(method: "PUT" | "POST", path: string, content: Blob | string): Promise<void> {
  const response = await fetch(path, { method, headers: headers(), body: content });
  if (!response.ok) throw await failure(response);
}

export const upload = (path: string, content: Blob) => send("PUT", path, content);

export async function download(path: string): Promise<Blob> {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await failure(response);
  return await response.blob();
}

export interface ServerEvent {
  id: string;
  event: string;
  data: string;
}

// An SSE stream read with fetch (EventSource cannot send the key): calls `onEvent` for each
// event until the server ends it or `signal` aborts.
export async function stream(
  path: string,
  onEvent: (event: ServerEvent) => void,
  signal: AbortSignal,
): Promise<void> {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok || !response.body) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end: number;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event: ServerEvent = { id: "", event: "message", data: "" };
      for (const line of block.split("\n")) {
        const colon = line.indexOf(":");
        if (colon <= 0) continue; // a comment (keep-alive) or nothing
        const field = line.slice(0, colon);
        const text = line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data += (event.data ? "\n" : "") + text;
        else if (field === "event") event.event = text;
        else if (field === "id") event.id = text;
      }
      if (event.data) onEvent(event);
    }
  }
}

export function socketUrl(path: string): string {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}`;
}

// ---- what the API answers (the fields the portal reads)

export interface Sandbox {
  name: string;
  state: string;
  template: string;
  metadata: Record<string, string>;
  worker: string | null;
  network: boolean;
  resources: Record<string, number>;
  workspaces: { name: string; path: string }[];
  timeout: number;
  created_at: string;
  started_at: string | null;
  expires_at: string | null;
  error: string | null;
}

export interface Process {
  pid: number;
  command: string;
  state: "running" | "exited";
  exit_code: number | null;
  started_at: string;
  terminal: boolean;
}

export interface FileEntry {
  name: string;
  path: string;
  type: "file" | "dir" | "symlink" | "other";
  size: number;
  mode: string;
  mtime: string;
}

export interface ExecJob {
  id: string;
  sandbox: string;
  state: string;
  command: string;
  exit_code: number | null;
  error: string | null;
  created_at: string;
  finished_at: string | null;
  stdout?: string;
  stderr?: string;
  stdout_truncated?: boolean;
  stderr_truncated?: boolean;
}

export interface Template {
  name: string;
  public: boolean;
  digest: string;
  source: string;
  size: number;
  layers: number;
  created_at: string;
}

export interface Workspace {
  name: string;
  id: string;
  quota_mb: number;
  head: string | null;
  mounted_by: string[];
  created_at: string;
}

export interface Worker {
  name: string;
  connected: boolean;
  capacity: number;
  live_sandboxes?: number;
  your_live_sandboxes?: number;
  features: Record<string, unknown>;
  last_seen_at: string;
}

export const sandboxPath = (name: string) => `/api/v1/sandboxes/${encodeURIComponent(name)}`;

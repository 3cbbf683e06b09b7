// Small pieces every view uses: links, errors, times, a poll.
import type { ComponentChildren } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "./api";
import { BASE, onLink } from "./router";

export function Link(props: { to: string; children: ComponentChildren; testid?: string }) {
  return (
    <a href={BASE + props.to} onClick={onLink(props.to)} data-testid={props.testid}>
      {props.children}
    </a>
  );
}

export function Problem(props: { error: unknown }) {
  if (!props.error) return null;
  const text = props.error instanceof Error ? props.error.message : String(props.error);
  return (
    <p class="error" role="alert">
      {text}
    </p>
  );
}

export function when(iso: string | null | undefined): string {
  if (!iso) return "—";
  const date = new Date(iso);
  return date.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

export function bytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// load(): the data, again every `every` ms while mounted; reload() at once. What it shows is
// never stale: a 404 (the thing is gone) drops the data, and so does a failure before the
// first answer for new deps (another folder, another sandbox).
export function usePoll<T>(load: () => Promise<T>, every: number, deps: unknown[] = []) {
  const [data, setData] = useState<T | null>(null);
  const [error, setError] = useState<unknown>(null);
  const tick = useRef(0);
  const [nonce, setNonce] = useState(0);
  const shown = useRef("");
  useEffect(() => {
    let live = true;
    const mine = ++tick.current;
    const key = JSON.stringify(deps);
    const run = async () => {
      try {
        const got = await load();
        if (live && mine === tick.current) {
          setData(got);
          setError(null);
          shown.current = key;
        }
      } catch (e) {
        if (!live) return;
        setError(e);
        if (shown.current !== key || (e instanceof ApiError && e.status === 404)) setData(null);
      }
    };
    run();
    const timer = every > 0 ? setInterval(run, every) : undefined;
    return () => {
      live = false;
      if (timer) clearInterval(timer);
    };
  }, [...deps, nonce]);
  return { data, error, reload: () => setNonce((n) => n + 1) };
}

// an action's busy flag and error, for buttons and forms
export function useAction() {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<unknown>(null);
  const run = async (action: () => Promise<unknown>): Promise<boolean> => {
    setBusy(true);
    setError(null);
    try {
      await action();
      return true;
    } catch (e) {
      setError(e);
      return false;
    } finally {
      setBusy(false);
    }
  };
  return { busy, error, run, clear: () => setError(null) };
}

// one line to type a command and a button to send it; cleared once `send` succeeded
export function CommandForm(props: {
  placeholder: string;
  button: string;
  busy: boolean;
  send: (command: string) => Promise<boolean>;
}) {
  const [command, setCommand] = useState("");
  return (
    <form
      class="inline"
      onSubmit={async (e) => {
        e.preventDefault();
        if (await props.send(command)) setCommand("");
      }}
    >
      <input
        class="wide"
        placeholder={props.placeholder}
        value={command}
        onInput={(e) => setCommand((e.target as HTMLInputElement).value)}
        required
      />
      <button type="submit" disabled={props.busy}>
        {props.button}
      </button>
    </form>
  );
}

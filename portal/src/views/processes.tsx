import { useEffect, useRef, useState } from "preact/hooks";
import { get, post, sandboxPath, send, stream, type Process } from "../api";
import { CommandForm, Problem, useAction, usePoll, when } from "../ui";

export function Processes(props: { name: string }) {
  const base = `${sandboxPath(props.name)}/toolbox/processes`;
  const list = usePoll(() => get<{ processes: Process[] }>(base), 3000, [props.name]);
  const [open, setOpen] = useState<number | null>(null);
  const action = useAction();
  return (
    <div>
      <CommandForm
        placeholder="a command, run by bash, e.g. python3 -m http.server 8000"
        button="Start"
        busy={action.busy}
        send={(command) =>
          action.run(async () => {
            const started = await post<Process>(base, { command });
            setOpen(started.pid);
            list.reload();
          })
        }
      />
      <Problem error={action.error ?? list.error} />
      <table>
        <thead>
          <tr>
            <th>PID</th>
            <th>Command</th>
            <th>State</th>
            <th>Started</th>
            <th></th>
          </tr>
        </thead>
        <tbody>
          {[...(list.data?.processes ?? [])].sort((a, b) => b.pid - a.pid).map((p) => (
            <tr key={p.pid}>
              <td>{p.pid}</td>
              <td>
                <code>{p.command}</code>
              </td>
              <td>{p.state === "exited" ? `exited (${p.exit_code})` : p.terminal ? "terminal" : "running"}</td>
              <td>{when(p.started_at)}</td>
              <td>
                {!p.terminal && <button onClick={() => setOpen(open === p.pid ? null : p.pid)}>Logs</button>}{" "}
                {p.state === "running" && (
                  <button
                    class="danger"
                    onClick={() => action.run(async () => {
                      await post(`${base}/${p.pid}/signal`, { signal: "SIGKILL" });
                      list.reload();
                    })}
                  >
                    Kill
                  </button>
                )}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {open !== null && <Logs base={base} pid={open} key={open} />}
    </div>
  );
}

// a process's output as it comes (the SSE stream from the start), and a line of stdin
function Logs(props: { base: string; pid: number }) {
  const [lines, setLines] = useState<{ stream: string; text: string }[]>([]);
  const [ended, setEnded] = useState<string | null>(null);
  const [input, setInput] = useState("");
  const action = useAction();
  const end = useRef<HTMLPreElement>(null);
  useEffect(() => {
    const abort = new AbortController();
    // bytes, as UTF-8 (bad bytes as U+FFFD), one decoder a stream: a character split across
    // two chunks stays whole
    const decoders: Record<string, TextDecoder> = {};
    const decode = (name: string, body: { data: string; encoding?: string }) => {
      const bytes = body.encoding === "base64"
        ? Uint8Array.from(atob(body.data), (c) => c.charCodeAt(0))
        : new TextEncoder().encode(body.data);
      decoders[name] ??= new TextDecoder();
      return decoders[name].decode(bytes, { stream: true });
    };
    stream(
      `${props.base}/${props.pid}/stream?offset=0`,
      (event) => {
        const body = JSON.parse(event.data);
        if (event.event === "exit") setEnded(`exited (${body.exit_code})`);
        else if (event.event === "dropped") setLines((l) => [...l, { stream: "note", text: `[${body.bytes} bytes dropped]\n` }]);
        else {
          const text = decode(event.event, body);
          if (text) setLines((l) => [...l.slice(-2000), { stream: event.event, text }]);
        }
      },
      abort.signal,
    ).catch((e) => {
      if (!abort.signal.aborted) setEnded(e instanceof Error ? e.message : String(e));
    });
    return () => abort.abort();
  }, [props.pid]);
  useEffect(() => end.current?.scrollTo(0, end.current.scrollHeight), [lines]);
  return (
    <div class="logs">
      <h3>
        Output of {props.pid} {ended && <span class="hint">— {ended}</span>}
      </h3>
      <pre ref={end} data-testid="process-output">
        {lines.map((l) => (
          <span class={l.stream}>{l.text}</span>
        ))}
      </pre>
      {!ended && (
        <form
          class="inline"
          onSubmit={(e) => {
            e.preventDefault();
            action.run(async () => {
              await send("POST", `${props.base}/${props.pid}/stdin`, input + "\n");
              setInput("");
            });
          }}
        >
          <input
            class="wide"
            placeholder="a line to its stdin"
            value={input}
            onInput={(e) => setInput((e.target as HTMLInputElement).value)}
          />
          <button type="submit" disabled={action.busy}>
            Send
          </button>
        </form>
      )}
      <Problem error={action.error} />
    </div>
  );
}

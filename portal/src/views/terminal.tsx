import { FitAddon } from "@xterm/addon-fit";
import { Terminal as XTerm } from "@xterm/xterm";
import "@xterm/xterm/css/xterm.css";
import { useEffect, useRef, useState } from "preact/hooks";
import { post, sandboxPath, socketUrl } from "../api";

// A shell in the sandbox over the PTY WebSocket: a short-lived token in the URL (a browser
// cannot send the key on a WebSocket), the terminal's bytes both ways, resizes as JSON text.
export function Terminal(props: { name: string }) {
  const box = useRef<HTMLDivElement>(null);
  const [status, setStatus] = useState("connecting…");
  const [generation, setGeneration] = useState(0);
  useEffect(() => {
    const term = new XTerm({ cursorBlink: true, convertEol: false, fontSize: 14, scrollback: 5000 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(box.current!);
    fit.fit();
    let socket: WebSocket | null = null;
    let closed = false;
    const encoder = new TextEncoder();
    (async () => {
      try {
        const { token } = await post<{ token: string }>(
          `${sandboxPath(props.name)}/toolbox/pty-token`,
          { ttl: 60 },
        );
        if (closed) return;
        const query = new URLSearchParams({ token, cols: String(term.cols), rows: String(term.rows) });
        socket = new WebSocket(socketUrl(`${sandboxPath(props.name)}/toolbox/pty?${query}`));
        socket.binaryType = "arraybuffer";
        socket.onopen = () => {
          setStatus("connected");
          term.focus();
        };
        socket.onmessage = (event) => {
          if (typeof event.data === "string") {
            const message = JSON.parse(event.data);
            if (message.type === "exit") setStatus(`the shell exited (${message.exit_code})`);
            return;
          }
          term.write(new Uint8Array(event.data as ArrayBuffer));
        };
        socket.onclose = () => setStatus((s) => (s.startsWith("the shell") ? s : "disconnected"));
        socket.onerror = () => setStatus("the connection failed");
      } catch (e) {
        setStatus(e instanceof Error ? e.message : String(e));
      }
    })();
    const input = term.onData((data) => socket?.readyState === WebSocket.OPEN && socket.send(encoder.encode(data)));
    const resized = term.onResize(({ cols, rows }) => {
      if (socket?.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "resize", cols, rows }));
    });
    const observer = new ResizeObserver(() => fit.fit());
    observer.observe(box.current!);
    return () => {
      closed = true;
      observer.disconnect();
      input.dispose();
      resized.dispose();
      socket?.close();
      term.dispose();
    };
  }, [props.name, generation]);
  return (
    <div>
      <p class="hint">
        Terminal: <span data-testid="terminal-status">{status}</span>{" "}
        {status !== "connected" && status !== "connecting…" && (
          <button onClick={() => { setStatus("connecting…"); setGeneration((g) => g + 1); }}>Reconnect</button>
        )}
      </p>
      <div class="terminal" ref={box} data-testid="terminal" />
    </div>
  );
}

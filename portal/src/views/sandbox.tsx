import { useState } from "preact/hooks";
import { ApiError, del, get, post, sandboxPath, type Sandbox as SandboxInfo } from "../api";
import { navigate } from "../router";
import { Link, Problem, useAction, usePoll, when } from "../ui";
import { Files } from "./files";
import { Jobs } from "./jobs";
import { Processes } from "./processes";
import { Terminal } from "./terminal";

const TABS = ["overview", "terminal", "processes", "files", "jobs"] as const;
type Tab = (typeof TABS)[number];

export function Sandbox(props: { name: string; tab: string }) {
  const tab: Tab = (TABS as readonly string[]).includes(props.tab) ? (props.tab as Tab) : "overview";
  const info = usePoll(() => get<SandboxInfo>(sandboxPath(props.name)), 5000, [props.name]);
  const running = info.data?.state === "running";
  return (
    <section>
      <h2>
        <Link to="/">Sandboxes</Link> / <span data-testid="sandbox-name">{props.name}</span>{" "}
        {info.data && <span class={`state ${info.data.state}`}>{info.data.state}</span>}
      </h2>
      {info.data && (
        <nav class="tabs">
          {TABS.map((t) => (
            <Link to={`/sandboxes/${props.name}/${t}`}>
              <span class={t === tab ? "tab active" : "tab"}>{t}</span>
            </Link>
          ))}
        </nav>
      )}
      <Problem error={info.error} />
      {!info.data && info.error instanceof ApiError && info.error.status === 404 && (
        <p class="hint">
          It was deleted, or it is another tenant's. <Link to="/">All sandboxes</Link>
        </p>
      )}
      {tab === "overview" && info.data && <Overview sandbox={info.data} onChange={info.reload} />}
      {tab !== "overview" && info.data && !running && (
        <p class="hint">The sandbox is {info.data.state}: this needs it running.</p>
      )}
      {running && tab === "terminal" && <Terminal name={props.name} />}
      {running && tab === "processes" && <Processes name={props.name} />}
      {running && tab === "files" && <Files name={props.name} />}
      {running && tab === "jobs" && <Jobs name={props.name} />}
    </section>
  );
}

function Overview(props: { sandbox: SandboxInfo; onChange: () => void }) {
  const s = props.sandbox;
  const [seconds, setSeconds] = useState("600");
  const [extended, setExtended] = useState<string | null>(null);
  const action = useAction();
  const rows: [string, string][] = [
    ["Template", s.template],
    ["Worker", s.worker ?? "—"],
    ["Network", s.network ? "on" : "off (loopback only)"],
    ["Resources", Object.entries(s.resources).map(([k, v]) => `${k}=${v}`).join(", ")],
    ["Workspaces", s.workspaces.map((w) => `${w.name} at ${w.path}`).join(", ") || "—"],
    ["Metadata", Object.entries(s.metadata).map(([k, v]) => `${k}=${v}`).join(", ") || "—"],
    ["Created", when(s.created_at)],
    ["Started", when(s.started_at)],
    ["Expires", when(s.expires_at)],
  ];
  if (s.error) rows.push(["Error", s.error]);
  return (
    <div>
      <dl class="facts" data-testid="overview">
        {rows.map(([k, v]) => (
          <>
            <dt>{k}</dt>
            <dd>{v}</dd>
          </>
        ))}
      </dl>
      <form
        class="inline"
        onSubmit={(e) => {
          e.preventDefault();
          setExtended(null);
          action.run(async () => {
            const got = await post<SandboxInfo>(`${sandboxPath(s.name)}/timeout`, { timeout: Number(seconds) });
            setExtended(got.expires_at);
            props.onChange();
          });
        }}
      >
        <label>
          Expire in (s){" "}
          <input
            type="number"
            min="1"
            required
            value={seconds}
            onInput={(e) => setSeconds((e.target as HTMLInputElement).value)}
          />
        </label>
        <button type="submit" disabled={action.busy}>
          Extend
        </button>
        <button
          type="button"
          class="danger"
          data-testid="delete-sandbox"
          disabled={action.busy}
          onClick={() => {
            if (confirm(`Delete ${s.name}? Its files go with it.`)) action.run(async () => {
              await del(sandboxPath(s.name));
              navigate("/");
            });
          }}
        >
          Delete sandbox
        </button>
      </form>
      {extended && !action.error && <p class="hint">Extended: it now expires {when(extended)}.</p>}
      <Problem error={action.error} />
    </div>
  );
}

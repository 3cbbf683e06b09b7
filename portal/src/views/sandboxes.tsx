import { useState } from "preact/hooks";
import { del, get, post, sandboxPath, type Sandbox, type Template } from "../api";
import { navigate } from "../router";
import { Link, Problem, useAction, usePoll, when } from "../ui";

const STATES = ["", "pending", "running", "stopped", "error"];

function parsePairs(text: string): Record<string, string> {
  const pairs: Record<string, string> = {};
  for (const part of text.split(",").map((p) => p.trim()).filter(Boolean)) {
    const eq = part.indexOf("=");
    if (eq <= 0) throw new Error(`metadata "${part}" is not KEY=VALUE`);
    pairs[part.slice(0, eq).trim()] = part.slice(eq + 1).trim();
  }
  return pairs;
}

export function Sandboxes() {
  const [state, setState] = useState("");
  const [filter, setFilter] = useState("");
  const [filterError, setFilterError] = useState<unknown>(null);
  const query = () => {
    const params = new URLSearchParams({ limit: "200" });
    if (state) params.set("state", state);
    for (const [k, v] of Object.entries(parsePairs(filter))) params.set(`metadata.${k}`, v);
    return params.toString();
  };
  const list = usePoll(
    async () => {
      let q: string;
      try {
        q = query();
        setFilterError(null);
      } catch (e) {
        setFilterError(e);
        return null;
      }
      return await get<{ sandboxes: Sandbox[] }>(`/api/v1/sandboxes?${q}`);
    },
    3000,
    [state, filter],
  );
  const remove = useAction();
  return (
    <section>
      <h2>Sandboxes</h2>
      <CreateSandbox onCreated={(name) => navigate(`/sandboxes/${name}`)} />
      <div class="filters">
        <label>
          State{" "}
          <select value={state} onChange={(e) => setState((e.target as HTMLSelectElement).value)}>
            {STATES.map((s) => (
              <option value={s}>{s || "live (not deleted)"}</option>
            ))}
          </select>
        </label>
        <label>
          Metadata filter{" "}
          <input
            placeholder="agent=demo, run=7"
            value={filter}
            onChange={(e) => setFilter((e.target as HTMLInputElement).value)}
          />
        </label>
      </div>
      <Problem error={filterError ?? list.error ?? remove.error} />
      <table data-testid="sandboxes">
        <thead>
          <tr>
            <th>Name</th>
            <th>State</th>
            <th>Template</th>
            <th>Metadata</th>
            <th>Created</th>
            <th>Expires</th>
            <th></th>
          </tr>
        </thead>
        <tbody>
          {list.data?.sandboxes.map((s) => (
            <tr key={s.name} data-sandbox={s.name}>
              <td>
                <Link to={`/sandboxes/${s.name}`}>{s.name}</Link>
              </td>
              <td class={`state ${s.state}`}>{s.state}</td>
              <td>{s.template}</td>
              <td>
                {Object.entries(s.metadata)
                  .map(([k, v]) => `${k}=${v}`)
                  .join(", ")}
              </td>
              <td>{when(s.created_at)}</td>
              <td>{when(s.expires_at)}</td>
              <td>
                <button
                  class="danger"
                  disabled={remove.busy}
                  onClick={() => {
                    if (confirm(`Delete ${s.name}? Its files go with it.`)) remove.run(async () => {
                      await del(sandboxPath(s.name));
                      list.reload();
                    });
                  }}
                >
                  Delete
                </button>
              </td>
            </tr>
          ))}
          {list.data && list.data.sandboxes.length === 0 && (
            <tr>
              <td colSpan={7} class="empty">
                No sandboxes{state || filter ? " match" : " yet"}.
              </td>
            </tr>
          )}
        </tbody>
      </table>
    </section>
  );
}

function CreateSandbox(props: { onCreated: (name: string) => void }) {
  const templates = usePoll(() => get<Template[]>("/api/v1/templates"), 0);
  const [template, setTemplate] = useState("default");
  const [timeout, setTimeoutValue] = useState("");
  const [metadata, setMetadata] = useState("");
  const action = useAction();
  const submit = (event: Event) => {
    event.preventDefault();
    action.run(async () => {
      const body: Record<string, unknown> = { template, metadata: parsePairs(metadata) };
      if (timeout) body.timeout = Number(timeout);
      const made = await post<Sandbox>("/api/v1/sandboxes", body);
      props.onCreated(made.name);
    });
  };
  const names = ["default", ...(templates.data ?? []).map((t) => t.name).filter((n) => n !== "default")];
  return (
    <form class="inline" onSubmit={submit} data-testid="create-sandbox">
      <label>
        Template{" "}
        <select value={template} onChange={(e) => setTemplate((e.target as HTMLSelectElement).value)}>
          {names.map((n) => (
            <option value={n}>{n}</option>
          ))}
        </select>
      </label>
      <label>
        Timeout (s){" "}
        <input
          type="number"
          min="1"
          placeholder="server default"
          value={timeout}
          onInput={(e) => setTimeoutValue((e.target as HTMLInputElement).value)}
        />
      </label>
      <label>
        Metadata{" "}
        <input
          placeholder="KEY=VALUE, …"
          value={metadata}
          onInput={(e) => setMetadata((e.target as HTMLInputElement).value)}
        />
      </label>
      <button type="submit" disabled={action.busy}>
        {action.busy ? "Creating…" : "Create sandbox"}
      </button>
      <Problem error={action.error} />
    </form>
  );
}

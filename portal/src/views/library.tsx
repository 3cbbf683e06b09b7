// The tenant's templates and workspaces.
import { useState } from "preact/hooks";
import { del, get, post, type Template, type Workspace } from "../api";
import { bytes, Problem, useAction, usePoll, when } from "../ui";

export function Templates() {
  const list = usePoll(() => get<Template[]>("/api/v1/templates"), 10_000);
  const action = useAction();
  return (
    <section>
      <h2>Templates</h2>
      <p class="hint">
        Build one with <code>sandgate template build NAME DIR</code> (a Dockerfile) or{" "}
        <code>POST /api/v1/templates</code>; a sandbox starts from one by name.
      </p>
      <Problem error={list.error ?? action.error} />
      <table>
        <thead>
          <tr>
            <th>Name</th>
            <th>Source</th>
            <th>Size</th>
            <th>Layers</th>
            <th>Digest</th>
            <th>Created</th>
            <th></th>
          </tr>
        </thead>
        <tbody>
          {list.data?.map((t) => (
            <tr key={t.name}>
              <td>
                {t.name} {t.public && <span class="tag">public</span>}
              </td>
              <td>{t.source}</td>
              <td>{bytes(t.size)}</td>
              <td>{t.layers}</td>
              <td>
                <code>{t.digest.slice(0, 19)}</code>
              </td>
              <td>{when(t.created_at)}</td>
              <td>
                <button
                  class="danger"
                  onClick={() => {
                    if (confirm(`Delete the template ${t.name}?`)) action.run(async () => {
                      await del(`/api/v1/templates/${encodeURIComponent(t.name)}`);
                      list.reload();
                    });
                  }}
                >
                  Delete
                </button>
              </td>
            </tr>
          ))}
          {list.data?.length === 0 && (
            <tr>
              <td colSpan={7} class="empty">No templates: sandboxes start from the default root.</td>
            </tr>
          )}
        </tbody>
      </table>
    </section>
  );
}

interface Commit {
  sha: string;
  author: { name: string };
  date: string;
  message: string;
}

export function Workspaces() {
  const list = usePoll(() => get<{ workspaces: Workspace[] }>("/api/v1/workspaces"), 5000);
  const [name, setName] = useState("");
  const [quota, setQuota] = useState("");
  const [open, setOpen] = useState<string | null>(null);
  const action = useAction();
  return (
    <section>
      <h2>Workspaces</h2>
      <form
        class="inline"
        onSubmit={(e) => {
          e.preventDefault();
          action.run(async () => {
            await post("/api/v1/workspaces", { name, ...(quota ? { quota_mb: Number(quota) } : {}) });
            setName("");
            setQuota("");
            list.reload();
          });
        }}
      >
        <input placeholder="name" value={name} onInput={(e) => setName((e.target as HTMLInputElement).value)} required />
        <input
          type="number"
          min="1"
          placeholder="quota (MiB)"
          value={quota}
          onInput={(e) => setQuota((e.target as HTMLInputElement).value)}
        />
        <button type="submit" disabled={action.busy}>
          Create workspace
        </button>
      </form>
      <Problem error={list.error ?? action.error} />
      <table>
        <thead>
          <tr>
            <th>Name</th>
            <th>Quota</th>
            <th>Head</th>
            <th>Mounted by</th>
            <th>Created</th>
            <th></th>
          </tr>
        </thead>
        <tbody>
          {list.data?.workspaces.map((w) => (
            <tr key={w.id}>
              <td>
                <a href="#" onClick={(e) => { e.preventDefault(); setOpen(w.name); }}>{w.name}</a>
              </td>
              <td>{w.quota_mb} MiB</td>
              <td>
                <code>{w.head?.slice(0, 10) ?? "—"}</code>
              </td>
              <td>{w.mounted_by.join(", ") || "—"}</td>
              <td>{when(w.created_at)}</td>
              <td>
                <button
                  class="danger"
                  onClick={() => {
                    if (confirm(`Delete the workspace ${w.name} and its history?`)) action.run(async () => {
                      await del(`/api/v1/workspaces/${encodeURIComponent(w.name)}`);
                      if (open === w.name) setOpen(null);
                      list.reload();
                    });
                  }}
                >
                  Delete
                </button>
              </td>
            </tr>
          ))}
          {list.data?.workspaces.length === 0 && (
            <tr>
              <td colSpan={6} class="empty">No workspaces yet: a sandbox mounts one by name.</td>
            </tr>
          )}
        </tbody>
      </table>
      {open && <History name={open} key={open} />}
    </section>
  );
}

function History(props: { name: string }) {
  const log = usePoll(
    () => get<{ commits: Commit[] }>(`/api/v1/workspaces/${encodeURIComponent(props.name)}/commits?limit=20`),
    0,
    [props.name],
  );
  return (
    <div class="logs">
      <h3>History of {props.name}</h3>
      <Problem error={log.error} />
      <ul class="commits">
        {log.data?.commits.map((c) => (
          <li key={c.sha}>
            <code>{c.sha.slice(0, 10)}</code> {c.message.split("\n")[0]}{" "}
            <span class="hint">
              — {c.author.name}, {when(c.date)}
            </span>
          </li>
        ))}
        {log.data?.commits.length === 0 && <li class="empty">No commits yet.</li>}
      </ul>
    </div>
  );
}

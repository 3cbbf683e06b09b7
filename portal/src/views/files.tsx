import { useRef, useState } from "preact/hooks";
import { ApiError, del, download, get, post, sandboxPath, upload, type FileEntry } from "../api";
import { bytes, Problem, useAction, usePoll, when } from "../ui";

function join(dir: string, name: string): string {
  return dir.endsWith("/") ? dir + name : `${dir}/${name}`;
}

// a sandbox without a template of its own has no "/": its files are under these roots
const ROOTS: FileEntry[] = ["/workspace", "/tmp"].map((path) => ({
  name: path.slice(1), path, type: "dir", size: 0, mode: "", mtime: "",
}));

function parent(dir: string): string {
  const up = dir.replace(/\/+$/, "").replace(/\/[^/]*$/, "");
  return up || "/";
}

export function Files(props: { name: string }) {
  const base = `${sandboxPath(props.name)}/toolbox/files`;
  const [dir, setDir] = useState("/workspace");
  const [typed, setTyped] = useState("/workspace");
  const list = usePoll(
    () => get<{ entries: FileEntry[] }>(`${base}/list?path=${encodeURIComponent(dir)}`),
    0,
    [dir],
  );
  const action = useAction();
  const uploads = useAction();
  const picker = useRef<HTMLInputElement>(null);
  const go = (to: string) => {
    setDir(to);
    setTyped(to);
    action.clear();
    uploads.clear();
  };
  const rootsOnly = dir === "/" && list.error instanceof ApiError && list.error.code === "path_outside_sandbox";
  const entries = [...(rootsOnly ? ROOTS : list.data?.entries ?? [])].sort(
    (a, b) => Number(b.type === "dir") - Number(a.type === "dir") || a.name.localeCompare(b.name),
  );
  return (
    <div>
      <form class="inline" onSubmit={(e) => { e.preventDefault(); go(typed || "/"); }}>
        <input class="wide" value={typed} onInput={(e) => setTyped((e.target as HTMLInputElement).value)} />
        <button type="submit">Open</button>
        <button type="button" onClick={() => go(parent(dir))} disabled={dir === "/"}>
          Up
        </button>
        <label class={uploads.busy || rootsOnly ? "button disabled" : "button"}>
          {uploads.busy ? "Uploading…" : "Upload"}
          <input
            ref={picker}
            type="file"
            multiple
            data-testid="upload"
            hidden
            disabled={uploads.busy || rootsOnly}
            onChange={() => uploads.run(async () => {
              const files = Array.from(picker.current?.files ?? []);
              if (picker.current) picker.current.value = ""; // the same file again is a change
              try {
                for (const file of files) {
                  await upload(`${base}?path=${encodeURIComponent(join(dir, file.name))}`, file);
                }
              } finally {
                list.reload(); // the ones sent before a failure are there
              }
            })}
          />
        </label>
        <button
          type="button"
          disabled={rootsOnly}
          onClick={() => {
            const name = prompt("New folder name");
            if (name) action.run(async () => {
              await post(`${base}/mkdir`, { path: join(dir, name) });
              list.reload();
            });
          }}
        >
          New folder
        </button>
      </form>
      <Problem error={uploads.error ?? action.error ?? (rootsOnly ? null : list.error)} />
      {rootsOnly && <p class="hint">This sandbox's files are under /workspace and /tmp.</p>}
      <table data-testid="files">
        <thead>
          <tr>
            <th>Name</th>
            <th>Size</th>
            <th>Mode</th>
            <th>Modified</th>
            <th></th>
          </tr>
        </thead>
        <tbody>
          {entries.map((f) => (
            <tr key={f.path} data-file={f.name}>
              <td>
                {f.type === "dir" ? (
                  <a href="#" onClick={(e) => { e.preventDefault(); go(f.path); }}>{f.name}/</a>
                ) : (
                  f.name
                )}
              </td>
              <td>{f.type === "file" ? bytes(f.size) : f.type}</td>
              <td>
                <code>{f.mode}</code>
              </td>
              <td>{when(f.mtime)}</td>
              <td>
                {!rootsOnly && f.type === "file" && (
                  <button
                    onClick={() => action.run(async () => {
                      const blob = await download(`${base}?path=${encodeURIComponent(f.path)}`);
                      const a = document.createElement("a");
                      a.href = URL.createObjectURL(blob);
                      a.download = f.name;
                      a.click();
                      setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
                    })}
                  >
                    Download
                  </button>
                )}{" "}
                {!rootsOnly && <button
                  class="danger"
                  onClick={() => {
                    if (confirm(`Delete ${f.path}?`)) action.run(async () => {
                      await del(`${base}?path=${encodeURIComponent(f.path)}&recursive=true`);
                      list.reload();
                    });
                  }}
                >
                  Delete
                </button>}
              </td>
            </tr>
          ))}
          {list.data && !rootsOnly && entries.length === 0 && (
            <tr>
              <td colSpan={5} class="empty">Empty folder.</td>
            </tr>
          )}
        </tbody>
      </table>
    </div>
  );
}

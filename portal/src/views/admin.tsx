// What an admin key sees of the deployment: workers, the admission queue and breaker, and
// the in-process state of the instance that answered.
import { get, type Worker } from "../api";
import { Problem, usePoll, when } from "../ui";

interface StateRow {
  name: string;
  holds: string;
  bound: string;
  under_n_instances: string;
  size: number | null;
}

export function Admin() {
  const workers = usePoll(() => get<{ workers: Worker[] }>("/api/v1/workers"), 5000);
  const admission = usePoll(() => get<Record<string, any>>("/api/v1/admission"), 5000);
  const state = usePoll(() => get<{ instance: string; rows: StateRow[] }>("/api/v1/admin/state"), 10_000);
  const a = admission.data;
  return (
    <section>
      <h2>Workers</h2>
      <Problem error={workers.error} />
      <table data-testid="workers">
        <thead>
          <tr>
            <th>Name</th>
            <th>Connected</th>
            <th>Live sandboxes</th>
            <th>Capacity</th>
            <th>Runtime</th>
            <th>Last seen</th>
          </tr>
        </thead>
        <tbody>
          {workers.data?.workers.map((w) => (
            <tr key={w.name}>
              <td>{w.name}</td>
              <td>{w.connected ? "yes" : "no"}</td>
              <td>{w.live_sandboxes ?? w.your_live_sandboxes ?? 0}</td>
              <td>{w.capacity}</td>
              <td>{String(w.features.runtime ?? "—")}</td>
              <td>{when(w.last_seen_at)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      <h2>Admission</h2>
      <Problem error={admission.error} />
      {a && (
        <dl class="facts" data-testid="admission">
          <dt>Queue</dt>
          <dd>
            {a.enabled ? `${a.queue?.length ?? 0} waiting (limit ${a.queue?.limit}, ${a.queue?.timeout} s)` : "off"}
          </dd>
          <dt>Breaker</dt>
          <dd>
            {a.breaker?.state}
            {a.breaker?.reason ? ` — ${a.breaker.reason}` : ""} ({a.breaker?.counted_timeouts} of{" "}
            {a.breaker?.threshold} timeouts in {a.breaker?.window} s)
          </dd>
          <dt>Recent timeouts</dt>
          <dd>
            {(a.recent_timeouts ?? []).length === 0
              ? "none"
              : (a.recent_timeouts as { at: string; sandbox: string; reason: string }[])
                  .map((t) => `${when(t.at)} ${t.sandbox}: ${t.reason}`)
                  .join("; ")}
          </dd>
        </dl>
      )}
      <h2>In-process state{state.data ? ` of ${state.data.instance}` : ""}</h2>
      <Problem error={state.error} />
      <table data-testid="state">
        <thead>
          <tr>
            <th>Name</th>
            <th>Size now</th>
            <th>Holds</th>
            <th>Bound</th>
            <th>With N instances</th>
          </tr>
        </thead>
        <tbody>
          {state.data?.rows.map((r) => (
            <tr key={r.name}>
              <td>
                <code>{r.name}</code>
              </td>
              <td>{r.size ?? "—"}</td>
              <td>{r.holds}</td>
              <td>{r.bound}</td>
              <td>{r.under_n_instances}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}

import { useState } from "preact/hooks";
import { get, post, sandboxPath, type ExecJob } from "../api";
import { CommandForm, Problem, useAction, usePoll, when } from "../ui";

// Exec jobs: commands that run to the end on their own, their output kept after they finish.
export function Jobs(props: { name: string }) {
  const list = usePoll(
    () => get<{ exec_jobs: ExecJob[] }>(`${sandboxPath(props.name)}/exec-jobs?limit=50`),
    2000,
    [props.name],
  );
  const [open, setOpen] = useState<string | null>(null);
  const action = useAction();
  return (
    <div>
      <CommandForm
        placeholder="a command to run as a job, e.g. make test"
        button="Submit job"
        busy={action.busy}
        send={(command) =>
          action.run(async () => {
            const job = await post<ExecJob>(`${sandboxPath(props.name)}/exec-jobs`, { command });
            setOpen(job.id);
            list.reload();
          })
        }
      />
      <Problem error={action.error ?? list.error} />
      <table>
        <thead>
          <tr>
            <th>Job</th>
            <th>Command</th>
            <th>State</th>
            <th>Created</th>
            <th>Finished</th>
          </tr>
        </thead>
        <tbody>
          {list.data?.exec_jobs.map((j) => (
            <tr key={j.id}>
              <td>
                <a href="#" onClick={(e) => { e.preventDefault(); setOpen(j.id); }}>{j.id}</a>
              </td>
              <td>
                <code>{j.command}</code>
              </td>
              <td class={`state ${j.state}`}>
                {j.state}
                {j.exit_code !== null ? ` (${j.exit_code})` : ""}
              </td>
              <td>{when(j.created_at)}</td>
              <td>{when(j.finished_at)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {open && <JobOutput id={open} key={open} />}
    </div>
  );
}

const ENDED = ["succeeded", "failed"];

function JobOutput(props: { id: string }) {
  const [ended, setEnded] = useState(false);
  const job = usePoll(
    async () => {
      const got = await get<ExecJob>(`/api/v1/exec-jobs/${props.id}`);
      if (got.finished_at || ENDED.includes(got.state)) setEnded(true);
      return got;
    },
    ended ? 0 : 2000, // an ended job changes no more
    [props.id, ended],
  );
  const j = job.data;
  return (
    <div class="logs">
      <h3>
        Job {props.id} {j && <span class="hint">— {j.state}{j.error ? `: ${j.error}` : ""}</span>}
      </h3>
      <Problem error={job.error} />
      {j && !ended && <p class="hint">Its output comes when it ends.</p>}
      <pre>
        <span class="stdout">{j?.stdout}</span>
        {j?.stdout_truncated && <span class="note">[stdout truncated]{"\n"}</span>}
        <span class="stderr">{j?.stderr}</span>
        {j?.stderr_truncated && <span class="note">[stderr truncated]{"\n"}</span>}
      </pre>
    </div>
  );
}

import { useState } from "preact/hooks";
import { get, saveKey, forgetKey } from "../api";
import { Problem, useAction } from "../ui";

// The key stays in this tab's sessionStorage only: closing the tab signs out.
export function SignIn(props: { onSignedIn: () => void }) {
  const [key, setKey] = useState("");
  const action = useAction();
  const submit = (event: Event) => {
    event.preventDefault();
    action.run(async () => {
      saveKey(key.trim());
      try {
        await get("/api/v1/workers"); // any key, tenant or admin, may read it
      } catch (e) {
        forgetKey();
        throw e;
      }
      props.onSignedIn();
    });
  };
  return (
    <main class="signin">
      <h1>sandgate</h1>
      <form onSubmit={submit}>
        <label>
          API key
          <input
            name="key"
            type="password"
            autocomplete="off"
            value={key}
            onInput={(e) => setKey((e.target as HTMLInputElement).value)}
            placeholder="sg_…"
            required
          />
        </label>
        <button type="submit" disabled={action.busy}>
          Sign in
        </button>
        <Problem error={action.error} />
        <p class="hint">
          Kept in this browser tab only. A key comes from <code>sandgate keys create</code>, or
          the one <code>sandgate up</code> printed.
        </p>
      </form>
    </main>
  );
}

import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { ApiError, forgetKey, get, savedKey } from "./api";
import { navigate, useRoute } from "./router";
import "./style.css";
import { Link } from "./ui";
import { Admin } from "./views/admin";
import { Templates, Workspaces } from "./views/library";
import { Sandbox } from "./views/sandbox";
import { Sandboxes } from "./views/sandboxes";
import { SignIn } from "./views/signin";

function App() {
  const [signedIn, setSignedIn] = useState(savedKey() !== null);
  const [admin, setAdmin] = useState<boolean | null>(null); // null: not known yet
  const route = useRoute();
  useEffect(() => {
    if (!signedIn) return;
    get<{ view: string }>("/api/v1/workers")
      .then((w) => setAdmin(w.view === "fleet"))
      .catch((e) => {
        if (e instanceof ApiError && e.status === 401) signOut();
        else setAdmin(false); // the pages say what fails
      });
  }, [signedIn]);
  const signOut = () => {
    forgetKey();
    setSignedIn(false);
    setAdmin(null);
    navigate("/");
  };
  if (!signedIn) return <SignIn onSignedIn={() => setSignedIn(true)} />;
  const parts = route.split("/").filter(Boolean);
  const tenantOnly = <p class="hint">An admin key runs no sandboxes: sign in with a tenant's key for this.</p>;
  let page;
  if (admin === null) page = <p class="hint">Loading…</p>; // a tenant page would only fail for an admin key
  else if (parts[0] === "sandboxes" && parts[1]) page = admin ? tenantOnly : <Sandbox name={parts[1]} tab={parts[2] ?? "overview"} />;
  else if (parts[0] === "templates") page = <Templates />;
  else if (parts[0] === "workspaces") page = admin ? tenantOnly : <Workspaces />;
  else if (parts[0] === "admin") page = admin ? <Admin /> : <p class="hint">The admin views take an admin key.</p>;
  else if (parts.length === 0 || parts[0] === "sandboxes") page = admin ? <Admin /> : <Sandboxes />;
  else page = <p class="hint">No page at /ui{route}. <Link to="/">Home</Link></p>;
  return (
    <>
      <header>
        <strong>sandgate</strong>
        <nav>
          {admin === false && <Link to="/">Sandboxes</Link>}
          <Link to="/templates">Templates</Link>
          {admin === false && <Link to="/workspaces">Workspaces</Link>}
          {admin && <Link to="/admin">Admin</Link>}
          <a href="/docs">API</a>
        </nav>
        <button class="quiet" onClick={signOut} data-testid="sign-out">
          Sign out
        </button>
      </header>
      <main>{page}</main>
    </>
  );
}

render(<App />, document.getElementById("app")!);

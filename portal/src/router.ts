// Paths under /ui, kept in the address bar (the server answers index.html for any of them).
import { useEffect, useState } from "preact/hooks";

export const BASE = "/ui";

export function navigate(to: string): void {
  history.pushState(null, "", BASE + to);
  dispatchEvent(new PopStateEvent("popstate"));
}

export function useRoute(): string {
  const read = () => location.pathname.replace(/^\/ui/, "") || "/";
  const [route, setRoute] = useState(read);
  useEffect(() => {
    const changed = () => setRoute(read());
    addEventListener("popstate", changed);
    return () => removeEventListener("popstate", changed);
  }, []);
  return route;
}

// a link that stays in the page
export function onLink(to: string) {
  return (event: MouseEvent) => {
    if (event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
    event.preventDefault();
    navigate(to);
  };
}

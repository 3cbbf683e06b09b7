import { defineConfig } from "vite";

// The portal is served by the API at /ui (src/sandgate/api/portal.py), its files from the
// Python package: the build writes them there, so `pip install` ships them.
export default defineConfig({
  base: "/ui/",
  build: {
    outDir: "../src/sandgate/api/portal_static",
    emptyOutDir: true,
    assetsDir: "assets",
    sourcemap: false,
    chunkSizeWarningLimit: 1024,
  },
  oxc: {
    jsx: { runtime: "automatic", importSource: "preact" },
  },
});

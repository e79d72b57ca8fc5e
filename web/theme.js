// Light and dark: the system's choice until the toggle picks one (remembered).

const THEME_STORE = "localheap.theme";
const DARK = matchMedia("(prefers-color-scheme: dark)");

function effective() {
  return document.documentElement.dataset.theme || (DARK.matches ? "dark" : "light");
}

/** Apply the remembered theme (none: follow the system) and label the toggle. */
export function applyTheme(theme = localStorage.getItem(THEME_STORE)) {
  if (theme) document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
  const next = effective() === "dark" ? "light" : "dark";
  const toggle = document.getElementById("theme-toggle");
  toggle.setAttribute("aria-label", `Switch to ${next} theme`);
  toggle.title = `Switch to ${next} theme`;
}

export function toggleTheme() {
  const theme = effective() === "dark" ? "light" : "dark";
  localStorage.setItem(THEME_STORE, theme);
  applyTheme(theme);
}

DARK.addEventListener("change", () => applyTheme());

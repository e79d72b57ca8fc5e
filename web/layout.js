// Phones and tablets (up to 900 px, see style.css): the chat fills the screen and the
// conversations and the heap panel are drawers over it, opened from the top bar.

const $ = (id) => document.getElementById(id);
const NARROW = matchMedia("(max-width: 900px)");
const PHONE = matchMedia("(max-width: 600px)");

/** Open a drawer ("sidebar" or "heap"), or close whichever is open (""). */
export function showPanel(name) {
  const before = document.body.dataset.panel || "";
  document.body.dataset.panel = name;
  $("scrim").hidden = !name;
  $("show-conversations").setAttribute("aria-expanded", String(name === "sidebar"));
  $("show-heap").setAttribute("aria-expanded", String(name === "heap"));
  if (name === "heap" && NARROW.matches) $("heap-panel").querySelector(".close-panel").focus();
  else if (!name && before) $(before === "heap" ? "show-heap" : "show-conversations").focus({ preventScroll: true });
}

// The full hint does not fit a phone's message box: the short one there (the hint stays for screen readers).
function placeholder() {
  $("prompt").placeholder = PHONE.matches ? "Message the model" : "Message the model  (Enter sends, Shift+Enter adds a line)";
}

export function enableNarrowLayout() {
  // Buttons with data-toggle-panel toggle that panel; the scrim (value "") closes whichever is open.
  document.addEventListener("click", (e) => {
    const target = e.target.closest("[data-toggle-panel]");
    if (!target) return;
    const name = target.dataset.togglePanel;
    showPanel(name && document.body.dataset.panel !== name ? name : "");
  });
  PHONE.addEventListener("change", placeholder);
  placeholder();
}

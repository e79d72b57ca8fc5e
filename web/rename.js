// Renaming a conversation: the pencil beside its title opens an input; Enter or leaving
// the field saves it on the server (PATCH /v1/sessions/{id}), Escape cancels.

import { request } from "./api.js";

const $ = (id) => document.getElementById(id);

export function enableRename({ convs, onChange, onError }) {
  const input = $("title-input");

  function start() {
    input.value = convs.title(convs.current);
    input.dataset.id = convs.current;
    input.hidden = false;
    $("chat-title").hidden = true;
    $("rename").hidden = true;
    input.focus();
    input.select();
  }

  async function end(save) {
    if (input.hidden) return;
    const id = input.dataset.id;
    const title = input.value.trim();
    input.hidden = true;
    $("chat-title").hidden = false;
    onChange();
    if (!save || !title || title === convs.title(id)) return;
    try {
      const info = await (await request("PATCH", `/v1/sessions/${encodeURIComponent(id)}`, { body: { title } })).json();
      convs.upsert(info);
      onChange();
    } catch (e) {
      onError(e);
    }
  }

  $("rename").addEventListener("click", start);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") end(true);
    else if (e.key === "Escape") end(false);
    else return;
    e.preventDefault();
    e.stopPropagation();   // Escape here neither stops a reply nor closes a panel
    $("prompt").focus();
  });
  input.addEventListener("blur", () => end(true));
}

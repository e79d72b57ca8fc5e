// The "Add a document" dialog: paste, choose or drop a text file; hands (name, text) on.
// Its token count comes from the server's tokenizer (POST /v1/tokenize).

import { postJSON } from "./api.js";
import { int } from "./format.js";

const $ = (id) => document.getElementById(id);
const HINT = "or drop one here, or paste below";
const TOKENIZE_MAX_CHARS = 4_000_000;   // the server's bound (schemas.TOKENIZE_MAX_CHARS)
const TOKENIZE_DELAY_MS = 250;          // typing or pasting: count once the text stops changing

export class DocumentDialog {
  constructor(onRead) {
    this.dialog = $("document-dialog");
    this.onRead = onRead;      // (name, text) => void
    this.name = null;          // the file's name; null for pasted text
    this.counting = null;      // {controller, timer} of the token count in flight
    document.addEventListener("click", (e) => {
      if (e.target.closest("[data-action=open-document]") && !e.target.closest("button:disabled")) this.show();
    });
    $("document-text").addEventListener("input", () => {
      this.name = null;
      this.describe();
    });
    $("document-file").addEventListener("change", (e) => this.read(e.target.files[0]));
    $("document-cancel").addEventListener("click", () => this.dialog.close());
    $("document-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.submit();
    });
    for (const target of [$("drop"), $("messages")]) this.acceptDrops(target);
  }

  get open() {
    return this.dialog.open;
  }

  show() {
    $("document-form").reset();
    this.name = null;
    $("document-file-name").textContent = HINT;
    this.describe();
    this.dialog.showModal();
    $("document-text").focus();
  }

  async read(file) {
    if (!file) return;
    this.name = file.name;
    $("document-file-name").textContent = file.name;
    $("document-text").value = await file.text();
    this.describe();
  }

  describe() {
    const text = $("document-text").value;
    const binary = text.includes("\u0000");
    const size = $("document-size");
    this.cancelCount();
    size.textContent = binary ? "This file does not look like plain text."
      : text ? `${int(text.length)} characters · counting tokens…` : "";
    $("document-submit").disabled = !text.trim() || binary;
    if (text && !binary) this.count(text);
  }

  // Tokens as the model counts them; an estimate only when the server cannot say.
  count(text) {
    const show = (tokens) => { $("document-size").textContent = `${int(text.length)} characters · ${tokens}`; };
    if (text.length > TOKENIZE_MAX_CHARS) return show(`about ${int(text.length / 4)} tokens (estimated: too long to count here)`);
    const controller = new AbortController();
    const timer = setTimeout(async () => {
      try {
        const { count } = await postJSON("/v1/tokenize", { text }, { signal: controller.signal });
        show(`${int(count)} tokens`);
        $("document-size").dataset.tokens = String(count);
      } catch (e) {
        if (e.name !== "AbortError") show(`about ${int(text.length / 4)} tokens (estimated: ${e.message})`);
      }
    }, TOKENIZE_DELAY_MS);
    this.counting = { controller, timer };
  }

  cancelCount() {
    if (!this.counting) return;
    clearTimeout(this.counting.timer);
    this.counting.controller.abort();
    this.counting = null;
    delete $("document-size").dataset.tokens;
  }

  submit() {
    const text = $("document-text").value;
    if (!text.trim() || text.includes("\u0000")) return;
    const firstLine = text.trim().split("\n", 1)[0].slice(0, 60);
    this.cancelCount();
    this.dialog.close();
    this.onRead(this.name || `Pasted text: ${firstLine}`, text);
  }

  acceptDrops(target) {
    target.addEventListener("dragover", (e) => {
      e.preventDefault();
      target.classList.add("dragging");
    });
    target.addEventListener("dragleave", () => target.classList.remove("dragging"));
    target.addEventListener("drop", (e) => {
      e.preventDefault();
      target.classList.remove("dragging");
      if (!this.open) this.show();
      this.read(e.dataTransfer.files[0]);
    });
  }
}

// The "Add a document" dialog: paste, choose or drop a text file; hands (name, text) on.

import { int } from "./format.js";

const $ = (id) => document.getElementById(id);
const HINT = "or drop one here, or paste below";

export class DocumentDialog {
  constructor(onRead) {
    this.dialog = $("document-dialog");
    this.onRead = onRead;      // (name, text) => void
    this.name = null;          // the file's name; null for pasted text
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
    $("document-size").textContent = binary ? "This file does not look like plain text."
      : text ? `${int(text.length)} characters (about ${int(text.length / 4)} tokens)` : "";
    $("document-submit").disabled = !text.trim() || binary;
  }

  submit() {
    const text = $("document-text").value;
    if (!text.trim() || text.includes("\u0000")) return;
    const firstLine = text.trim().split("\n", 1)[0].slice(0, 60);
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

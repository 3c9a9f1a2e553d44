// Small DOM helpers shared by the panels.

export const $ = (id) => document.getElementById(id);

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

export function showError(node, error) {
  if (!error) {
    node.hidden = true;
    node.textContent = "";
    return;
  }
  node.hidden = false;
  node.textContent = error.message || String(error);
}

export function fmtBytes(n) {
  if (n == null) return "";
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}

export function fillSelect(select, names) {
  const keep = select.value;
  select.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
  if (names.includes(keep)) select.value = keep;
  select.disabled = names.length === 0;
}

/** Wire a drop zone (a <label> around a file input) so dropped files act like chosen ones. */
export function dropZone(zone, input, onFiles) {
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    onFiles([...e.dataTransfer.files]);
  });
  input.addEventListener("change", () => {
    onFiles([...input.files]);
  });
}

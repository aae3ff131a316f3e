#!/usr/bin/env node
// Validates rendered Kubernetes objects (a JSON array, from tests/deploy/render.py) against the
// Kubernetes API schemas of the npm package kubernetes-models (and, for ServiceMonitor,
// @kubernetes-models/prometheus-operator): types, enums and required fields through each model's
// validate(), and unknown fields (a misspelt `readinesProbe`) by walking every object along the
// API's property lists, read from the packages' type declarations (as kubeconform --strict does;
// the models' own validators accept extra properties).
//   node k8s_validate.js objects.json
// Exit status: 0 valid, 1 a problem (each printed), 77 the npm tools are not installed.
"use strict";
const fs = require("fs");
const path = require("path");
const MODULES = path.join(__dirname, "node_modules");
if (!fs.existsSync(path.join(MODULES, "kubernetes-models"))) {
  console.log("SKIPPED: kubernetes-models missing (run scripts/install-deps.sh)");
  process.exit(77);
}

// ---- the API's property lists, from the .d.ts declarations ----------------------------------
// A type is {object: {name: type}, map: type|null} | {array: type} | {ref: name, file} | {any}.
const ANY = { any: true };
const files = new Map();  // .d.ts path -> {types: Map(name -> type), imports: Map(name -> path)}

function resolveModule(from, spec) {
  const base = spec.startsWith(".") ? path.resolve(path.dirname(from), spec)
                                    : path.join(MODULES, spec);
  return base.endsWith(".d.ts") ? base : base + ".d.ts";
}

function parseTypeText(text, file) {
  let i = 0;
  const ws = () => { while (i < text.length && /\s/.test(text[i])) i++; };
  const ident = () => { ws(); const m = /^[A-Za-z_$][\w$]*/.exec(text.slice(i)); i += m ? m[0].length : 0; return m ? m[0] : ""; };
  function primary() {
    ws();
    if (text[i] === "{") return objectType();
    if (text[i] === '"') { i = text.indexOf('"', i + 1) + 1; return ANY; }
    if (/[0-9-]/.test(text[i])) { while (/[0-9.eE-]/.test(text[i])) i++; return ANY; }
    const name = ident();
    ws();
    if (name === "Array" && text[i] === "<") { i++; const of = union(); ws(); i++; return { array: of }; }
    if (text[i] === "<") {  // other generics: skip
      let depth = 0;
      do { if (text[i] === "<") depth++; if (text[i] === ">") depth--; i++; } while (depth > 0);
      return ANY;
    }
    if (text[i] === "[") { i = text.indexOf("]", i) + 1; return ANY; }  // IFoo["kind"]
    if (["string", "number", "boolean", "any", "unknown", "null", "object"].includes(name)) return ANY;
    return { ref: name, file };
  }
  function union() {
    const parts = [primary()];
    for (ws(); text[i] === "|"; ws()) { i++; parts.push(primary()); }
    const structured = parts.filter((p) => !p.any);
    return structured.length === 1 ? structured[0] : ANY;
  }
  function objectType() {
    i++;  // {
    const object = {};
    let map = null;
    for (ws(); text[i] !== "}"; ws()) {
      if (text[i] === "[") {  // [key: string]: T
        i = text.indexOf("]", i) + 1; ws(); i++;  // ':'
        map = union();
      } else {
        let name;
        if (text[i] === '"') { const end = text.indexOf('"', i + 1); name = text.slice(i + 1, end); i = end + 1; }
        else name = ident();
        ws(); if (text[i] === "?") i++;
        ws(); i++;  // ':'
        object[name] = union();
      }
      ws(); if (text[i] === ";" || text[i] === ",") i++;
    }
    i++;  // }
    return { object, map };
  }
  return union;
}

function loadFile(file) {
  if (files.has(file)) return files.get(file);
  const entry = { types: new Map(), imports: new Map() };
  files.set(file, entry);
  if (!fs.existsSync(file)) return entry;
  const text = fs.readFileSync(file, "utf8").replace(/\/\*[\s\S]*?\*\//g, "");
  for (const m of text.matchAll(/import \{([^}]*)\} from "([^"]+)"/g)) {
    for (const n of m[1].split(",").map((s) => s.trim()).filter(Boolean)) {
      const [orig, as] = n.split(/\s+as\s+/);
      entry.imports.set((as || orig).trim(), { file: resolveModule(file, m[2]), name: orig.trim() });
    }
  }
  for (const m of text.matchAll(/export interface (\w+)[^{]*\{/g)) {
    const start = m.index + m[0].length - 1;
    const parse = parseTypeText(text.slice(start), file);
    entry.types.set(m[1], parse());
  }
  for (const m of text.matchAll(/export type (\w+) = ([^;]+);/g)) entry.types.set(m[1], ANY);
  for (const m of text.matchAll(/export \{([^}]*)\}(?! from)/g)) {
    for (const n of m[1].split(",")) {
      const [orig, as] = n.trim().split(/\s+as\s+/);
      if (as && entry.types.has(orig)) entry.types.set(as, entry.types.get(orig));
    }
  }
  for (const m of text.matchAll(/export \{([^}]*)\} from "([^"]+)"/g)) {
    for (const n of m[1].split(",")) {
      const [orig, as] = n.trim().split(/\s+as\s+/);
      entry.imports.set((as || orig).trim(), { file: resolveModule(file, m[2]), name: orig.trim() });
    }
  }
  return entry;
}

function resolve(type, depth = 0) {
  if (!type.ref || depth > 8) return type.ref ? ANY : type;
  const entry = loadFile(type.file);
  if (entry.types.has(type.ref)) return resolve(entry.types.get(type.ref), depth + 1);
  const imp = entry.imports.get(type.ref);
  if (!imp) return ANY;
  return resolve({ ref: imp.name, file: imp.file }, depth + 1);
}

function walk(value, type, where, problems) {
  type = resolve(type);
  if (type.any || value === null || typeof value !== "object") return;
  if (type.array) {
    if (Array.isArray(value)) value.forEach((v, k) => walk(v, type.array, `${where}[${k}]`, problems));
    return;
  }
  if (!type.object || Array.isArray(value)) return;
  for (const [key, v] of Object.entries(value)) {
    if (key in type.object) walk(v, type.object[key], `${where}.${key}`, problems);
    else if (type.map) walk(v, type.map, `${where}.${key}`, problems);
    else problems.push(`${where}.${key}: unknown field`);
  }
}

// ---- models by apiVersion / kind ---------------------------------------------------------------
function modelFile(apiVersion, kind) {
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    return path.join(MODULES, "@kubernetes-models/prometheus-operator", apiVersion, kind);
  }
  return path.join(MODULES, "kubernetes-models", apiVersion, kind);  // "v1", "apps/v1", ...
}

function validateObject(obj) {
  const name = `${obj.kind}/${(obj.metadata || {}).name}`;
  const file = modelFile(String(obj.apiVersion), String(obj.kind));
  if (!fs.existsSync(file + ".js")) return [`${name}: no schema for ${obj.apiVersion} ${obj.kind}`];
  const problems = [];
  const Model = Object.values(require(file)).find((v) => typeof v === "function" && v.kind === obj.kind);
  try {
    new Model(obj).validate();
  } catch (e) {
    problems.push(`${name}: ${e.message}`);
  }
  const dts = loadFile(file + ".d.ts");
  const iface = [...dts.types.keys()].find((k) => k === "I" + obj.kind);
  if (!iface) problems.push(`${name}: no type declaration for unknown-field checks`);
  else walk(obj, { ref: iface, file: file + ".d.ts" }, name, problems);
  return problems;
}

const objects = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const problems = objects.flatMap(validateObject);
for (const p of problems) console.log("INVALID " + p);
console.log(`${objects.length} objects, ${problems.length} problems`);
process.exit(problems.length ? 1 : 0);

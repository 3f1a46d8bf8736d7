// Validates an AsyncAPI document with the official parser; prints diagnostics as JSON.
// Exit 0 when the document parses without errors, 1 otherwise.
import { readFileSync } from "node:fs";
import { Parser } from "@asyncapi/parser";

const path = process.argv[2];
const parser = new Parser();
const { document, diagnostics } = await parser.parse(readFileSync(path, "utf8"), { source: path });
const errors = diagnostics.filter((d) => d.severity === 0);
const out = {
  valid: document !== undefined && errors.length === 0,
  errors: errors.map((d) => ({ code: d.code, message: d.message, path: d.path.join(".") })),
  warnings: diagnostics.filter((d) => d.severity === 1).map((d) => ({ code: d.code, message: d.message, path: d.path.join(".") })),
  channels: document ? document.channels().length : 0,
  operations: document ? document.operations().length : 0,
  messages: document ? document.components().messages().length : 0,
};
console.log(JSON.stringify(out));
process.exit(out.valid ? 0 : 1);

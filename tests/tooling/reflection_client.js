#!/usr/bin/env node
// A grpcurl-style client written against the public protocols only: @grpc/grpc-js for transport,
// protobufjs for messages. It starts the real server, asks server reflection (v1, then v1alpha)
// for the list of services, fetches the descriptors of every one, builds a type registry from
// them alone and calls grpc.health.v1.Health/Check and logitserve.v1.Scorer/ListHeads through it.
// No logitserve .proto file is read: what a user of grpcurl, Postman or grpc-js meets.
//
//   node reflection_client.js --server-binary build/server/logitserve
// Exit status: 0 pass, 1 a check failed, 77 the npm tools are not installed (ctest: skipped).
"use strict";
const { spawn } = require("child_process");
let grpc, protobuf, descriptor;
try {
  grpc = require("@grpc/grpc-js");
  protobuf = require("protobufjs");
  descriptor = require("protobufjs/ext/descriptor");
} catch (e) {
  console.log("SKIPPED: npm tools missing (run scripts/install-deps.sh): " + e.message);
  process.exit(77);
}

// The reflection protocol's messages (grpc/reflection/v1/reflection.proto; v1alpha has the same
// fields), written here from the protocol so the check does not reuse the server's copy.
const reflectionProto = protobuf.parse(`
  syntax = "proto3";
  package r;
  message Request {
    string host = 1;
    oneof message_request {
      string file_by_filename = 3;
      string file_containing_symbol = 4;
      string list_services = 7;
    }
  }
  message Response {
    string valid_host = 1;
    Request original_request = 2;
    oneof message_response {
      FileDescriptorResponse file_descriptor_response = 4;
      ListServiceResponse list_services_response = 6;
      ErrorResponse error_response = 7;
    }
  }
  message FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
  message ListServiceResponse { repeated ServiceResponse service = 1; }
  message ServiceResponse { string name = 1; }
  message ErrorResponse { int32 error_code = 1; string error_message = 2; }
`, { keepCase: true }).root;
const ReflRequest = reflectionProto.lookupType("r.Request");
const ReflResponse = reflectionProto.lookupType("r.Response");

function fail(message) {
  console.error("FAIL: " + message);
  process.exitCode = 1;
  throw new Error(message);
}

function startServer(binary) {
  return new Promise((resolve, reject) => {
    const child = spawn(binary, ["--listen", "127.0.0.1:0", "--synthetic-head",
                                 "policy:vocab=300,hidden=16,seed=1", "--threads", "1"],
                        { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/logitserve listening on (\S+)/);
      if (m) resolve({ child, address: m[1] });
    });
    child.on("exit", (code) => reject(new Error("server exited " + code + ": " + out)));
  });
}

// One reflection stream: each request gets its answer in order.
function reflectionSession(client, version) {
  const path = `/grpc.reflection.${version}.ServerReflection/ServerReflectionInfo`;
  const call = client.makeBidiStreamRequest(
      path, (m) => Buffer.from(ReflRequest.encode(ReflRequest.create(m)).finish()),
      (b) => ReflResponse.toObject(ReflResponse.decode(b)));
  const waiting = [];
  call.on("data", (r) => waiting.shift().resolve(r));
  call.on("error", (e) => { while (waiting.length) waiting.shift().reject(e); });
  return {
    ask(request) {
      return new Promise((resolve, reject) => {
        waiting.push({ resolve, reject });
        call.write(request);
      });
    },
    end() { call.end(); },
  };
}

async function describeAll(client, version) {
  const session = reflectionSession(client, version);
  const listed = await session.ask({ list_services: "" });
  if (!listed.list_services_response) fail(`${version}: list_services: ${JSON.stringify(listed)}`);
  const services = listed.list_services_response.service.map((s) => s.name).sort();
  const expected = ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection", "logitserve.v1.Scorer"];
  if (JSON.stringify(services) !== JSON.stringify(expected)) {
    fail(`${version}: services ${services} != ${expected}`);
  }
  const files = new Map();  // name -> FileDescriptorProto
  for (const service of services) {
    const r = await session.ask({ file_containing_symbol: service });
    if (r.error_response) fail(`${version}: describe ${service}: ${r.error_response.error_message}`);
    for (const bytes of r.file_descriptor_response.file_descriptor_proto) {
      const file = descriptor.FileDescriptorProto.decode(bytes);
      files.set(file.name, file);
    }
  }
  const missing = await session.ask({ file_containing_symbol: "no.such.Service" });
  if (!missing.error_response || missing.error_response.error_code !== grpc.status.NOT_FOUND) {
    fail(`${version}: unknown symbol: ${JSON.stringify(missing)}`);
  }
  session.end();
  console.log(`${version}: ${services.length} services, ${files.size} files: ` +
              [...files.keys()].sort().join(", "));
  return { services, files };
}

function unary(client, root, service, method, request) {
  const m = root.lookupService(service).methods[method];
  const reqType = root.lookupType(m.requestType);
  const resType = root.lookupType(m.responseType);
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(`/${service}/${method}`,
        (o) => Buffer.from(reqType.encode(reqType.create(o)).finish()),
        (b) => resType.toObject(resType.decode(b), { enums: String, longs: Number }),
        request, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

async function main() {
  const i = process.argv.indexOf("--server-binary");
  if (i < 0) fail("usage: reflection_client.js --server-binary PATH");
  const { child, address } = await startServer(process.argv[i + 1]);
  const client = new grpc.Client(address, grpc.credentials.createInsecure());
  try {
    await describeAll(client, "v1alpha");
    const { files } = await describeAll(client, "v1");
    // A registry built from the reflected descriptors alone (dependencies included).
    const root = protobuf.Root.fromDescriptor({ file: [...files.values()] }).resolveAll();
    const scorer = root.lookupService("logitserve.v1.Scorer");
    const methods = Object.keys(scorer.methods).sort();
    for (const m of ["ListHeads", "LoadHead", "Score", "ScoreStream"]) {
      if (!methods.includes(m)) fail(`Scorer lacks ${m}: ${methods}`);
    }
    const health = await unary(client, root, "grpc.health.v1.Health", "Check", { service: "" });
    if (health.status !== "SERVING") fail("health: " + JSON.stringify(health));
    const heads = await unary(client, root, "logitserve.v1.Scorer", "ListHeads", {});
    if (heads.heads.length !== 1 || heads.heads[0].name !== "policy" ||
        heads.heads[0].vocab_size !== 300 || heads.heads[0].hidden_size !== 16 ||
        !heads.server_info || !heads.server_info.version) {
      fail("ListHeads: " + JSON.stringify(heads));
    }
    console.log(`health ${health.status}; ListHeads via reflected types: ` +
                `${heads.heads[0].name} vocab ${heads.heads[0].vocab_size}, server ` +
                JSON.stringify(heads.server_info));
    console.log("PASS");
  } finally {
    client.close();
    child.kill("SIGTERM");
  }
}

main().catch((e) => {
  if (!process.exitCode) console.error("FAIL: " + (e.stack || e));
  process.exitCode = 1;
});

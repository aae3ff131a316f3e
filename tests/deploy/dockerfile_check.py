"""Static checks of the top-level Dockerfile against the repository (CI has no container engine).

check_dockerfile(text, repo, dockerignore_text) returns a list of problems (empty = fine):
  - every COPY/ADD source taken from the build context exists in the repository and is not
    excluded by .dockerignore (for `COPY . dest`: every CMakeLists.txt the top-level one reaches
    through add_subdirectory);
  - every `COPY --from=STAGE` names an earlier stage, and its source path is produced by a RUN of
    that stage; a binary copied out of the CMake build dir (/build/DIR/NAME) is an
    add_executable(NAME ...) of DIR/CMakeLists.txt;
  - every script a RUN executes (*.sh, *.py) was copied into the image from the context before
    that RUN, and exists and is not excluded there;
  - the final stage runs as a non-root numeric USER, EXPOSEs the gRPC port, has an ENTRYPOINT
    of the server and a HEALTHCHECK calling `logitserve-cli health`.
"""

import os
import posixpath
import re
import shlex


def logical_lines(text):
    """Dockerfile instructions: comments dropped, `\\` continuations joined."""
    out, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment line inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        current += stripped
        out.append(current.strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def parse_instructions(text):
    result = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def _exec_form(rest):
    import json

    if rest.startswith("["):
        try:
            return json.loads(rest)
        except ValueError:
            return None
    return None


def _copy_args(rest):
    """(flags dict, sources list, dest) of a COPY/ADD instruction (shell or JSON form)."""
    words = _exec_form(rest)
    if words is None:
        words = shlex.split(rest)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    if len(words) < 2:
        return flags, [], ""
    return flags, words[:-1], words[-1]


class DockerIgnore:
    """The .dockerignore rules: patterns in order, `!` re-includes, the last match wins, and a
    pattern matching a folder excludes everything below it."""

    def __init__(self, text):
        self.rules = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:].strip()
            pattern = posixpath.normpath(line.lstrip("/"))
            self.rules.append((negate, re.compile(self._regex(pattern))))

    @staticmethod
    def _regex(pattern):
        out, i = "", 0
        while i < len(pattern):
            c = pattern[i]
            if pattern.startswith("**/", i):
                out += "(?:.*/)?"
                i += 3
                continue
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
                continue
            out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
        return "^" + out + "$"

    def ignored(self, relpath):
        relpath = posixpath.normpath(relpath)
        if relpath == ".":
            return False
        parts = relpath.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, regex in self.rules:
            if any(regex.match(p) for p in prefixes):
                result = not negate
        return result


def _cmake_files(repo):
    """Every CMakeLists.txt the top-level one reaches through add_subdirectory, recursively (the
    files `COPY . dest` must bring for the configure to succeed)."""
    found, pending = [], [""]
    while pending:
        folder = pending.pop()
        rel = posixpath.join(folder, "CMakeLists.txt") if folder else "CMakeLists.txt"
        found.append(rel)
        path = os.path.join(repo, rel)
        if not os.path.isfile(path):
            continue
        for sub in re.findall(r"^\s*add_subdirectory\(\s*([\w./-]+)", open(path).read(), re.M):
            pending.append(posixpath.normpath(posixpath.join(folder, sub)))
    return found


def _is_executable_target(repo, build_path):
    """`/build/DIR/NAME` -> DIR/CMakeLists.txt declares add_executable(NAME ...)."""
    rel = posixpath.relpath(build_path, "/build")
    directory, name = posixpath.split(rel)
    cmake = os.path.join(repo, directory, "CMakeLists.txt")
    if not os.path.isfile(cmake):
        return False
    return re.search(r"add_executable\(\s*" + re.escape(name) + r"[\s)]", open(cmake).read())


def check_dockerfile(text, repo, dockerignore_text):
    problems = []
    ignore = DockerIgnore(dockerignore_text)
    instructions = parse_instructions(text)

    def context_problem(rel, what):
        rel = posixpath.normpath(rel)
        if not os.path.exists(os.path.join(repo, rel)):
            problems.append(f"{what}: {rel} does not exist in the repository")
        elif ignore.ignored(rel):
            problems.append(f"{what}: {rel} is excluded by .dockerignore")

    stages = []  # [{name, runs: [text], copied: {container path: context path}}]
    workdir = "/"
    for keyword, rest in instructions:
        if keyword == "FROM":
            m = re.search(r"\s+AS\s+(\S+)\s*$", rest, re.I)
            stages.append({"name": m.group(1) if m else str(len(stages)), "runs": [],
                           "copied": {}, "user": None, "expose": [], "entrypoint": None,
                           "healthcheck": None})
            workdir = "/"
            continue
        if not stages:
            if keyword != "ARG":
                problems.append(f"{keyword} before the first FROM")
            continue
        stage = stages[-1]
        if keyword == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif keyword in ("COPY", "ADD"):
            flags, sources, dest = _copy_args(rest)
            if not sources:
                problems.append(f"{keyword} {rest}: needs a source and a destination")
                continue
            dest_abs = posixpath.join(workdir, dest)
            if "from" in flags:
                names = [s["name"] for s in stages[:-1]]
                if flags["from"] not in names:
                    problems.append(f"COPY --from={flags['from']}: no earlier stage of that name")
                    continue
                source_stage = stages[names.index(flags["from"])]
                for src in sources:
                    produced = [r for r in source_stage["runs"]
                                if src.rstrip("/") in r or posixpath.dirname(src.rstrip("/")) in r]
                    if not produced:
                        problems.append(f"COPY --from={flags['from']} {src}: no RUN of that stage "
                                        f"writes it")
                continue
            for src in sources:
                if re.match(r"^[a-z]+://", src):
                    continue  # ADD of a URL: nothing in the context
                rel = posixpath.normpath(src)
                if rel == ".":
                    for needed in _cmake_files(repo):
                        context_problem(needed, f"{keyword} . (the build needs it)")
                else:
                    context_problem(rel, keyword)
                # Container path -> context path, for the scripts RUN executes later.
                target = dest_abs if not dest.endswith("/") or rel == "." else \
                    posixpath.join(dest_abs, posixpath.basename(rel))
                stage["copied"][posixpath.normpath(target)] = rel
        elif keyword == "RUN":
            stage["runs"].append(rest)
            # A file taken out of the CMake build folder must be a target the tree declares.
            for built in re.findall(r"(?<![\w.-])/build/((?:[\w.+-]+/)+[\w+-]+)(?![\w./-])", rest):
                if not _is_executable_target(repo, "/build/" + built):
                    problems.append(f"RUN uses /build/{built}: no add_executable("
                                    f"{posixpath.basename(built)}) in "
                                    f"{posixpath.dirname(built)}/CMakeLists.txt")
            for script in re.findall(r"(?:^|[\s;&|(])((?:\.{0,2}/)?[\w./-]+\.(?:sh|py))\b", rest):
                path = posixpath.normpath(posixpath.join(workdir, script))
                source = None
                for container, rel in stage["copied"].items():
                    if path == container:
                        source = rel
                    elif path.startswith(container.rstrip("/") + "/"):
                        source = posixpath.normpath(posixpath.join(rel, path[len(container) + 1:]))
                if source is None:
                    problems.append(f"RUN {script}: not copied into the image from the context "
                                    f"before this RUN")
                else:
                    context_problem(source, f"RUN {script}")
        elif keyword == "USER":
            stage["user"] = rest
        elif keyword == "EXPOSE":
            stage["expose"] += rest.split()
        elif keyword == "ENTRYPOINT":
            stage["entrypoint"] = _exec_form(rest) or shlex.split(rest)
        elif keyword == "HEALTHCHECK":
            stage["healthcheck"] = rest

    if not stages:
        return problems + ["no FROM"]
    final = stages[-1]
    user = (final["user"] or "0").split(":")[0]
    if not user.isdigit() or int(user) == 0:
        problems.append(f"final stage USER {final['user']}: must be a numeric non-root uid")
    if "50051" not in [p.split("/")[0] for p in final["expose"]]:
        problems.append("final stage does not EXPOSE 50051")
    if not final["entrypoint"] or posixpath.basename(final["entrypoint"][0]) != "logitserve":
        problems.append(f"final stage ENTRYPOINT {final['entrypoint']}: must run logitserve")
    hc = final["healthcheck"] or ""
    if not re.search(r"logitserve-cli\"?\s*,?\s*\"?health\b", hc):
        problems.append("final stage HEALTHCHECK must run `logitserve-cli health`")
    if len(stages) < 2:
        problems.append("not a multi-stage build")
    return problems

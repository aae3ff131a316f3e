"""The Dockerfile and .dockerignore against the repository (dockerfile_check.py), and the checker
itself against broken copies, so a check that cannot fail is caught here."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dockerfile_check  # noqa: E402

REPO = os.environ.get("LOGITSERVE_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
DOCKERFILE = open(os.path.join(REPO, "Dockerfile")).read()
DOCKERIGNORE = open(os.path.join(REPO, ".dockerignore")).read()


def check(dockerfile=DOCKERFILE, dockerignore=DOCKERIGNORE):
    return dockerfile_check.check_dockerfile(dockerfile, REPO, dockerignore)


def replaced(old, new, text=DOCKERFILE):
    assert old in text, f"the Dockerfile no longer contains {old!r}; update this test"
    return text.replace(old, new)


def test_dockerfile_passes():
    assert check() == []


def test_dockerfile_shape():
    instructions = dockerfile_check.parse_instructions(DOCKERFILE)
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert len(froms) >= 2
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    # The same install script and CMake build as CI, with CUDA switchable and its archs a build-arg.
    assert "scripts/install-deps.sh" in runs
    assert "scripts/test.sh" in runs
    assert "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" in runs
    args = [rest.split("=")[0] for keyword, rest in instructions if keyword == "ARG"]
    assert "CUDA_ARCHS" in args and "LOGITSERVE_CUDA" in args


def test_continuation_and_comments_are_joined():
    text = "FROM a AS b\nRUN echo one \\\n  # a comment\n  two\nUSER 1\n"
    assert dockerfile_check.parse_instructions(text) == [
        ("FROM", "a AS b"), ("RUN", "echo one two"), ("USER", "1")]


def test_missing_copy_source_is_reported():
    broken = replaced("COPY scripts/install-deps.sh /src/scripts/install-deps.sh",
                      "COPY scripts/no-such-script.sh /src/scripts/install-deps.sh")
    assert any("scripts/no-such-script.sh does not exist" in p for p in check(broken))


def test_copy_source_excluded_by_dockerignore_is_reported():
    problems = check(dockerignore=DOCKERIGNORE + "\nscripts/install-deps.sh\n")
    assert any("scripts/install-deps.sh is excluded by .dockerignore" in p for p in problems)
    # A folder the build needs, excluded by a wildcard, under `COPY . /src`.
    problems = check(dockerignore=DOCKERIGNORE + "\nser*\n")
    assert any("server/CMakeLists.txt is excluded" in p for p in problems)
    # ... and re-included by a later `!` rule: fine again.
    assert check(dockerignore=DOCKERIGNORE + "\nser*\n!server\n") == []
    # A nested folder the build adds (client/python from client/CMakeLists.txt).
    problems = check(dockerignore=DOCKERIGNORE + "\nclient/python\n")
    assert any("client/python/CMakeLists.txt is excluded" in p for p in problems), problems


def test_run_script_not_copied_first_is_reported():
    broken = replaced("COPY scripts/install-deps.sh /src/scripts/install-deps.sh\n", "")
    assert any("RUN /src/scripts/install-deps.sh: not copied" in p for p in check(broken))


def test_run_script_missing_from_repo_is_reported():
    broken = replaced("bash scripts/test.sh", "bash scripts/gone.sh")
    assert any("scripts/gone.sh does not exist" in p for p in check(broken))


def test_copy_from_unknown_stage_is_reported():
    broken = replaced("COPY --from=build /out/bin/", "COPY --from=builder /out/bin/")
    assert any("--from=builder: no earlier stage" in p for p in check(broken))


def test_copy_from_path_no_stage_writes_is_reported():
    broken = replaced("COPY --from=build /out/bin/logitserve ",
                      "COPY --from=build /opt/elsewhere/logitserve ")
    assert any("/opt/elsewhere/logitserve: no RUN of that stage writes it" in p
               for p in check(broken))


def test_binary_that_is_no_cmake_target_is_reported():
    broken = replaced("/build/client/cli/logitserve-cli", "/build/client/cli/logitserve-client")
    assert any("no add_executable(logitserve-client)" in p for p in check(broken))


def test_final_stage_rules_are_enforced():
    assert any("non-root" in p for p in check(replaced("USER 10001:10001", "USER root")))
    assert any("EXPOSE 50051" in p for p in check(replaced("EXPOSE 50051", "EXPOSE 8080")))
    assert any("HEALTHCHECK" in p
               for p in check(replaced('"health", "--target"', '"heads", "--target"')))
    assert any("ENTRYPOINT" in p for p in check(
        replaced('ENTRYPOINT ["/usr/local/bin/logitserve",', 'ENTRYPOINT ["/bin/sh",')))


def test_dockerignore_semantics():
    ignore = dockerfile_check.DockerIgnore("build*\n**/*.pyc\n.git\n!build-keep\n")
    assert ignore.ignored("build/x/y.o")
    assert ignore.ignored("build-cuda")
    assert not ignore.ignored("build-keep/file")
    assert ignore.ignored("tests/deploy/__pycache__/a.pyc")
    assert ignore.ignored("a.pyc")
    assert ignore.ignored(".git/HEAD")
    assert not ignore.ignored("server/main.cc")
    assert not ignore.ignored(".gitignore.d")

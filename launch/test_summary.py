"""One line per test suite from the reports launch/test.sh collects (ctest's and pytest's JUnit
XML, the wheel consumer's result, the documentation build's): what ran, what was skipped and
why, what failed.

    python3 launch/test_summary.py build/test-reports

Exits 1 when a suite failed or left no report."""
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET

ANSI = re.compile(r"(\x1b|\[NON-XML-CHAR-0x1B\])\[[0-9;]*m")


def skip_messages(text):
    """The messages of GTEST_SKIP() in a test's output: the first line after each 'file:line:
    Skipped' that is neither another such line nor a gtest status line (ranks interleave)."""
    lines = text.splitlines()
    found = []
    for i, l in enumerate(lines):
        if l.endswith(": Skipped"):
            for nxt in lines[i + 1:]:
                if not nxt.endswith(": Skipped") and not nxt.startswith("[") and nxt.strip():
                    found.append(nxt.strip())
                    break
    return found


FAILED = []  # "suite: test" for each failure, listed above the summary lines


def why(reasons):
    """'reason' or 'n: reason; m: other' for the skip reasons seen."""
    if not reasons:
        return ""
    counts = collections.Counter(r[:110] for r in reasons)
    if len(counts) == 1:
        return f" ({next(iter(counts))})"
    return " (" + "; ".join(f"{n}: {r}" for r, n in counts.most_common()) + ")"


def line(name, ran, skipped, failed, reasons, note=""):
    return f"{name}: ran {ran}{note}, skipped {skipped}{why(reasons)}, failed {failed}"


def ctest_lines(path, wheel_result):
    cases = list(ET.parse(path).getroot().iter("testcase"))
    out, bad = [], False
    single = [c for c in cases if not c.get("name").startswith(("mpi_", "install_consumer"))]
    mpi = [c for c in cases if c.get("name").startswith("mpi_")]
    consumer = [c for c in cases if c.get("name").startswith("install_consumer")]

    def text(c):
        return ANSI.sub("", c.findtext("system-out") or "")

    # one gtest case per ctest test
    ran = [c for c in single if c.get("status") != "notrun"]
    failed = [c for c in ran if c.get("status") != "run"]
    reasons = [(skip_messages(text(c)) or ["not run"])[0] for c in single if c.get("status") == "notrun"]
    out.append(line("C++ single", len(ran), len(single) - len(ran), len(failed), reasons))
    bad |= bool(failed)
    for c in failed:
        FAILED.append(f"C++ single: {c.get('name')}")

    # mpirun: each ctest test is one run of every multi-rank gtest case; counted as rank 0 reports
    if mpi:
        n_ran = n_skip = n_fail = 0
        reasons, runs = [], []
        for c in mpi:
            t = text(c)
            suite, np = c.get("name").rsplit("_np", 1)  # mpi_<suite>_np<N>
            runs.append((suite.removeprefix("mpi_"), np))
            passed = re.search(r"\[  PASSED  \] (\d+) test", t)
            skipped = re.search(r"\[  SKIPPED \] (\d+) test", t)
            fails = re.search(r"\[  FAILED  \] (\d+) test", t)
            p, s = int(passed.group(1)) if passed else 0, int(skipped.group(1)) if skipped else 0
            f = int(fails.group(1)) if fails else (0 if c.get("status") == "run" else 1)
            n_ran, n_skip, n_fail = n_ran + p + f, n_skip + s, n_fail + f
            if s:
                reasons += (sorted(set(skip_messages(t))) or ["not run"])[:1] * s
            if c.get("status") != "run":
                bad = True
                runs[-1] = (runs[-1][0], runs[-1][1] + " failed")
                FAILED.append(f"C++ mpirun: {c.get('name')}")
        by_suite = {}  # "vocab_parallel np 2, 3, 4; linear_cross_entropy np 2, 3"
        for suite, np in runs:
            by_suite.setdefault(suite, []).append(np)
        where = "; ".join(f"{suite} np {', '.join(nps)}" for suite, nps in by_suite.items())
        out.append(line("C++ mpirun", n_ran, n_skip, n_fail, reasons, f" ({where})"))
        bad |= n_fail > 0
    else:
        out.append("C++ mpirun: not built (no MPI)")

    ran = len(consumer)
    failed = [c.get("name") for c in consumer if c.get("status") != "run"]
    what = [c.get("name").replace("install_consumer", "CMake install").replace("_cpu_only", " CPU-only")
            for c in consumer]
    if wheel_result is not None:
        ran += 1
        what.append("wheel")
        if wheel_result != "passed":
            failed.append("wheel")
    reasons = [] if wheel_result is not None else ["wheel: the Python step did not reach it"]
    out.append(line("C++ install consumer", ran, len(reasons), len(failed), reasons, f" ({', '.join(what)})"))
    bad |= bool(failed) or wheel_result is None
    FAILED.extend(f"C++ install consumer: {f}" for f in failed)
    return out, bad


def pytest_line(name, path):
    cases = list(ET.parse(path).getroot().iter("testcase"))
    skipped = [c.find("skipped") for c in cases if c.find("skipped") is not None]
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    reasons = [re.sub(r"^Skipped: ", "", s.get("message", "")) for s in skipped]
    out = [line(name, len(cases) - len(skipped), len(skipped), len(failed), reasons)]
    FAILED.extend(f"{name}: {c.get('classname')}::{c.get('name')}" for c in failed)
    return out, bool(failed)


def docs_line(path):
    """The documentation build (launch/docs.sh's docs.json): one check, the strict build."""
    import json
    if not os.path.exists(path):
        return "Docs: did not run", True
    with open(path) as f:
        report = json.load(f)
    failed = report.get("status") != "passed"
    note = f" (mkdocs build --strict: {report.get('pages', 0)} pages, {report.get('seconds', '?')} s)"
    if failed:
        FAILED.extend(f"Docs: {p}" for p in report.get("problems", [])[:10] or ["mkdocs build --strict"])
    return line("Docs", 1, 0, int(failed), [], note), failed


def main(reports):
    lines, bad = [], False
    wheel = os.path.join(reports, "wheel_consumer.txt")
    wheel_result = open(wheel).read().strip() if os.path.exists(wheel) else None
    ctest = os.path.join(reports, "ctest.xml")
    if os.path.exists(ctest):
        more, b = ctest_lines(ctest, wheel_result)
        lines += more
        bad |= b
    else:
        lines.append("C++ (ctest): did not run")
        bad = True
    found = False
    for f in sorted(os.listdir(reports), key=len):  # pytest.xml (the main run) first
        m = re.match(r"pytest(-(.+))?\.xml$", f)
        if m:
            found = True
            name = "Python pytest" + (f" ({m.group(2)})" if m.group(2) else "")
            more, b = pytest_line(name, os.path.join(reports, f))
            lines += more
            bad |= b
    if not found:
        lines.append("Python pytest: did not run")
        bad = True
    more, b = docs_line(os.path.join(reports, "docs.json"))
    lines.append(more)
    bad |= b
    if FAILED:
        print("failed tests:\n  " + "\n  ".join(FAILED))
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/test-reports"))

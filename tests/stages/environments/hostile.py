"""A labelled test environment for the hostile-tool tests (issue 41, Must show 4), by import path
``tests.stages.environments.hostile:Hostile``: the ``code`` environment, whose every model turn is
taken as a ``python`` tool call of the program its prompt names (``prompt.metadata["hostile"]``),
whatever the model wrote; ``raises`` makes its ``step`` raise instead. Not a task."""

from __future__ import annotations


from gfcr.records import Prompt
from gfcr.stages.environments import Action, ToolCall
from gfcr.stages.environments.code import Code

TAG = "gfcr-hostile-tool-child"
# a child started past the audit hook (``_posixsubprocess.fork_exec`` raises no audit event), tagged
# so a test can look for it; the arguments are CPython 3.11's
FORK_PAST_THE_HOOK = f'''import _posixsubprocess, os, sys
_posixsubprocess.fork_exec([sys.executable, "-c", "import time; time.sleep(60)", {TAG!r}],
                           [os.fsencode(sys.executable)], True, (), None, None, -1, -1, -1, -1, -1, -1,
                           *os.pipe(), True, False, -1, None, None, None, -1, None, False)
print("started")
'''
PROGRAMS = {
    "sleeps_forever": "import time\nwhile True:\n    time.sleep(1)\n",
    "writes_2gb_to_a_file": ("with open('big', 'wb') as f:\n    for _ in range(2048):\n"
                             "        f.write(bytes(1 << 20))\n"),
    "allocates_2gb": "blob = bytearray(2 << 30)\n",
    "returns_100mb_of_text": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
    "forks": "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n",
    "kills_its_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "forks_past_the_audit_hook": FORK_PAST_THE_HOOK,
    "benign": "print(6 * 7)\n",
}


class Hostile(Code):
    """``code``, its turns replaced by the hostile program its prompt names (see the module docstring)."""

    def reset(self, prompt: Prompt, seed: int) -> None:
        super().reset(prompt, seed)
        self.kind = str(prompt.metadata["hostile"])

    def step(self, action: Action) -> object:
        if self.kind == "raises":
            raise RuntimeError("the tool server crashed")
        return super().step(Action(action.text, ToolCall("python", {"code": PROGRAMS[self.kind]})))

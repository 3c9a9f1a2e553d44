"""The entry module pie-media's build puts beside a Pie 0.4 Python inferlet (guest side).

It exports ``pie:app/run`` (``run(input) -> result<string, string>``): the input JSON is
decoded to a dict, the inferlet's ``async def main(input)`` runs on ``pie_loop``'s asyncio
loop (its only wait is ``wasi:io/poll.poll``), and any exception becomes the ``err`` case.
"""

import json
import traceback

import main as user_main  # the inferlet's main.py (imported at build time: componentize-py bundles what is imported then)
import pie_loop
from componentize_py_types import Err
from wit_world import exports


def _result_text(value) -> str:
    if value is None:
        try:
            import inferlet

            value = inferlet.get_return_value()
        except ImportError:
            value = None
        return "" if value is None else str(value)
    return value if isinstance(value, str) else json.dumps(value, default=str)


class Run(exports.Run):
    def run(self, input: str) -> str:
        try:
            args = json.loads(input) if input.strip() else {}
        except ValueError as e:
            raise Err(f"the input is not JSON: {e}") from None
        try:
            return _result_text(pie_loop.run(user_main.main(args)))
        except Err:
            raise
        except BaseException as e:  # noqa: BLE001 - every failure is the run's err case
            tb = traceback.format_exc(limit=8)
            print(tb)
            raise Err(f"{type(e).__name__}: {e}") from None

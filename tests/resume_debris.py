"""For tests: after a resume, what a failed checkpoint read can leave behind and Python
collects later, from another thread: an asyncio task whose error was never retrieved,
and an object whose finaliser raises ("Event loop is closed")."""

import asyncio
import gc
import threading

from april_jax.run import trainer

_resume = trainer.Trainer._resume  # pylint: disable=protected-access


def _debris() -> None:
  async def fails():
    raise OSError("a read of a damaged file")

  loop = asyncio.new_event_loop()
  task = loop.create_task(fails())
  loop.run_until_complete(asyncio.sleep(0.01))  # the task runs and fails
  loop.close()
  del task

  class Raises:

    def __del__(self):
      raise RuntimeError("Event loop is closed")

  Raises()
  gc.collect()


def _resume_then_debris(self) -> None:
  _resume(self)
  worker = threading.Thread(target=_debris)
  worker.start()
  worker.join()


trainer.Trainer._resume = _resume_then_debris  # pylint: disable=protected-access

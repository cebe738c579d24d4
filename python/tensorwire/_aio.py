"""asyncio support: awaiting a Request waits for it on the default executor,
so the event loop never blocks and no callback ever enters Python from a
progress thread."""

import asyncio


async def await_request(request):
    if request.done():
        request.wait(0)  # raises the operation's error, if any
        return None
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, request.wait)
    return None

from worker.ipc.server import main

main()

from worker.serve.main import main

main()

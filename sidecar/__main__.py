from sidecar.main import main

main()

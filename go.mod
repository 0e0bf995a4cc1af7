module github.com/rtrs-go/rtrs

go 1.26.0

require github.com/sirupsen/logrus v1.10.2

require golang.org/x/sys v0.49.0

require github.com/google/uuid v1.6.0

require github.com/hanwen/go-fuse/v2 v2.12.1

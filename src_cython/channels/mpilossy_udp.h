/* What both datagram transports share: the completion event their poll
 * hands out, and the UDP socket of this process found by its address
 * (libfabric's udp provider does not hand its socket out) to size its
 * kernel buffers and read its drop counter. */
#ifndef MPILOSSY_UDP_H
#define MPILOSSY_UDP_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One completed operation of a transport (mpilossy_fabric.h, mpilossy_sockets.h). */
typedef struct {
    void *context;        /* what the caller passed when posting */
    size_t len;           /* received bytes (receives) */
    int is_recv;
} mpl_fab_event_t;

#ifdef __linux__
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

/* The UDP socket of this process bound to `addr` (libfabric's udp provider
 * does not hand its socket out).  Returns the descriptor or -1. */
static int mpl_udp_socket(const void *addr, size_t addrlen)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int found = -1;
    if (!d)
        return -1;
    while ((e = readdir(d)) != NULL && found < 0) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof(ss);
        struct stat st;
        int fd = atoi(e->d_name);
        if (fd <= 2 || fstat(fd, &st) || !S_ISSOCK(st.st_mode))
            continue;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) == 0 && len == addrlen &&
            memcmp(&ss, addr, addrlen) == 0)
            found = fd;
    }
    closedir(d);
    return found;
}

/* Make the socket's kernel buffers `bytes` large: a burst of datagrams must
 * not overflow the receive queue while this rank is busy.  Above the system
 * limit (net.core.rmem_max) this needs CAP_NET_ADMIN.  Returns the receive
 * buffer size in effect, or -1 when the socket was not found. */
static int mpl_udp_tune(const void *addr, size_t addrlen, int bytes)
{
    int fd = mpl_udp_socket(addr, addrlen), got = 0;
    socklen_t len = sizeof(got);
    if (fd < 0)
        return -1;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof(bytes)))
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof(bytes)))
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &got, &len);
    return got;
}

/* Datagrams the kernel dropped because this socket's queue was full: the
 * `drops` column of /proc/net/udp(6) for the socket's inode.  -1 if unknown. */
static long mpl_udp_drops(const void *addr, size_t addrlen)
{
    int fd = mpl_udp_socket(addr, addrlen);
    struct stat st;
    char line[512];
    long drops = -1;
    const char *tables[2] = {"/proc/net/udp", "/proc/net/udp6"};
    if (fd < 0 || fstat(fd, &st))
        return -1;
    for (int t = 0; t < 2 && drops < 0; t++) {
        FILE *f = fopen(tables[t], "r");
        if (!f)
            continue;
        while (fgets(line, sizeof(line), f)) {
            unsigned long inode = 0;
            long d = 0;
            /* sl local rem st tx:rx tr:tm retrnsmt uid timeout inode ref pointer drops */
            if (sscanf(line, "%*s %*s %*s %*s %*s %*s %*s %*s %*s %lu %*s %*s %ld", &inode, &d) == 2
                && inode == (unsigned long)st.st_ino) {
                drops = d;
                break;
            }
        }
        fclose(f);
    }
    return drops;
}

#else  /* not Linux */

static int mpl_udp_tune(const void *addr, size_t addrlen, int bytes) { (void)addr; (void)addrlen; (void)bytes; return -1; }
static long mpl_udp_drops(const void *addr, size_t addrlen) { (void)addr; (void)addrlen; return -1; }

#endif
#endif /* MPILOSSY_UDP_H */

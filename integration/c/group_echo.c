/* A distributed server's echo server in C, on ferry's handoff library
 * (include/ferry_handoff.h): what the C ABI's test runs. It serves the
 * group's port; a new connection's first line is echoed here, then the
 * group's placement policy chooses its server (ferry_place) and it is
 * handed there (ferry_handoff) with the line as the state; a connection
 * handed to this process (ferry_accept) is echoed from then on.
 * Usage: group_echo PORT */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ferry_handoff.h"

static uint16_t port;

static void echo_rest(int conn)
{
	char buf[4096];
	ssize_t n;

	while ((n = read(conn, buf, sizeof(buf))) > 0)
		if (write(conn, buf, (size_t)n) != n)
			break;
	close(conn);
}

/* A new connection: its first line echoed here, then placed. */
static void *serve_new(void *arg)
{
	int conn = (int)(intptr_t)arg;
	char line[256], node[256];
	size_t len = 0;
	int here;

	while (len < sizeof(line) - 1) {
		ssize_t n = read(conn, line + len, 1);
		if (n <= 0) {
			close(conn);
			return NULL;
		}
		len++;
		if (line[len - 1] == '\n')
			break;
	}
	if (write(conn, line, len) != (ssize_t)len) {
		close(conn);
		return NULL;
	}
	here = ferry_place(port, node, sizeof(node));
	if (here == 0 && ferry_handoff(conn, node, line, len, 0) == 0) {
		close(conn); /* the acceptor's now: closing sends nothing */
		return NULL;
	}
	if (here < 0)
		fprintf(stderr, "ferry_place: %s\n", ferry_handoff_error());
	echo_rest(conn);
	return NULL;
}

static void *serve_handed(void *arg)
{
	echo_rest((int)(intptr_t)arg);
	return NULL;
}

static void *take_handed(void *arg)
{
	int channel = (int)(intptr_t)arg;

	for (;;) {
		char state[256];
		size_t state_len = sizeof(state);
		pthread_t t;
		int conn = ferry_accept(channel, state, &state_len);

		if (conn < 0) {
			fprintf(stderr, "ferry_accept: %s\n", ferry_handoff_error());
			exit(1);
		}
		pthread_create(&t, NULL, serve_handed, (void *)(intptr_t)conn);
		pthread_detach(t);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	struct sockaddr_in addr = {.sin_family = AF_INET};
	int one = 1, listener, channel = -1;
	pthread_t t;

	if (argc != 2)
		return 2;
	port = (uint16_t)atoi(argv[1]);
	addr.sin_port = htons(port);
	listener = socket(AF_INET, SOCK_STREAM, 0);
	setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(listener, (struct sockaddr *)&addr, sizeof(addr)) || listen(listener, 128))
		return 1;
	/* The group may be created after the server starts. */
	for (int i = 0; i < 300 && channel < 0; i++) {
		channel = ferry_serve(port);
		if (channel < 0)
			usleep(100 * 1000);
	}
	if (channel < 0) {
		fprintf(stderr, "ferry_serve: %s (errno %d)\n", ferry_handoff_error(), errno);
		return 1;
	}
	pthread_create(&t, NULL, take_handed, (void *)(intptr_t)channel);
	for (;;) {
		int conn = accept(listener, NULL, NULL);

		if (conn < 0)
			continue;
		pthread_create(&t, NULL, serve_new, (void *)(intptr_t)conn);
		pthread_detach(t);
	}
}
